"""The CPU layer's plain linears and single-rank mappings (moerl/compat/megatron_patches.py,
``plain_linears`` and ``single_rank_mappings``) give megatron-core's own results: a whole
model's logits and every gradient, bit for bit, against megatron-core's autograd
functions (the originals, restored for the reference pass), in both families."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moerl.parallel import spawn

SITES = {
    "megatron.core.tensor_parallel.layers": (
        "linear_with_grad_accumulation_and_async_allreduce",
        "copy_to_tensor_model_parallel_region",
        "reduce_from_tensor_model_parallel_region",
    ),
    "megatron.core.transformer.moe.shared_experts": (
        "copy_to_tensor_model_parallel_region",
        "reduce_from_tensor_model_parallel_region",
    ),
    "megatron.core.transformer.moe.token_dispatcher": ("all_to_all",),
}


def _nodes(root: object) -> set[str]:
    """The names of every autograd node behind ``root``."""
    seen, todo, names = set(), [root], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


def _compare(family: str, dtype: str, out: str) -> None:
    import importlib

    from moerl.compat import megatron_patches
    from moerl.models.gpt import build_model
    from moerl.models.tiny import tiny_config
    from moerl.parallel import parse_layout
    from moerl.parallel.state import initialize_for_model
    from moerl.trainer.wrap import wrap_ddp

    originals = {(owner.__name__, name): fn for owner, name, fn in megatron_patches._originals}
    model = tiny_config(family)
    pcfg, _ = parse_layout("single")
    initialize_for_model(pcfg, model, seed=3)
    chunks = wrap_ddp(build_model(model, pcfg, dtype), use_distributed_optimizer=False)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (3, 11), generator=gen)
    positions = torch.arange(11).expand(3, 11)
    record: dict = {"patched": []}

    def run() -> tuple[torch.Tensor, list[torch.Tensor], set[str]]:
        chunks[0].zero_grad_buffer()
        logits = chunks[0](tokens, positions, None)
        record["logits_dtype"] = str(logits.dtype)
        logits.float().pow(2).mean().backward()
        params = [p for p in chunks[0].parameters() if p.requires_grad]
        return logits.detach(), [p.main_grad.clone() for p in params], _nodes(logits.grad_fn)

    patched = run()
    replaced = {}  # (module, name) -> the patched function, put back after the reference
    for module, names in SITES.items():
        site = importlib.import_module(module)
        for name in names:
            replaced[(module, name)] = getattr(site, name)
            record["patched"].append(replaced[(module, name)] is not originals[(module, name)])
            setattr(site, name, originals[(module, name)])
    try:
        reference = run()
    finally:
        for (module, name), fn in replaced.items():
            setattr(importlib.import_module(module), name, fn)
    record["logits_equal"] = torch.equal(patched[0], reference[0])
    record["grads"] = len(patched[1])
    record["grads_equal"] = all(torch.equal(a, b) for a, b in zip(patched[1], reference[1]))
    record["grads_nonzero"] = sum(bool(g.any()) for g in patched[1])
    record["nodes_patched"] = sorted(patched[2])
    record["nodes_reference"] = sorted(reference[2])
    Path(out).write_text(json.dumps(record))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["deepseek_moe", "qwen3_moe"])
def test_plain_linears_and_single_rank_mappings_match_megatron_core(tmp_path, family, dtype):
    out = tmp_path / "linears.json"
    spawn(_compare, 1, family, dtype, str(out))
    record = json.loads(out.read_text())
    assert all(record["patched"]), record["patched"]
    assert record["logits_equal"]
    assert record["grads_equal"] and record["grads_nonzero"] > record["grads"] // 2
    megatron_fn = "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    assert megatron_fn in record["nodes_reference"] and megatron_fn not in record["nodes_patched"]
    for mapping in ("_CopyToModelParallelRegionBackward", "_AllToAllBackward"):
        assert mapping not in record["nodes_patched"]
