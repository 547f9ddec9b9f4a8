"""The CPU layer's finalize-time router walks (moerl/compat/megatron_patches.py,
``cached_router_walks``) give megatron-core's own results: the expert-bias update and the
reset of the routers' token counts, on a real model with routers in several layers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moerl.parallel import spawn


def _compare(out: str) -> None:
    import importlib

    from moerl.compat import megatron_patches
    from moerl.models.gpt import build_model
    from moerl.models.tiny import tiny_config
    from moerl.parallel import parse_layout
    from moerl.parallel.state import initialize_for_model
    from moerl.trainer.wrap import wrap_ddp

    site = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    originals = {name: fn for owner, name, fn in megatron_patches._originals if owner is site}
    model = tiny_config("deepseek_moe")
    pcfg, _ = parse_layout("single")
    initialize_for_model(pcfg, model, seed=3)
    chunks = wrap_ddp(build_model(model, pcfg), use_distributed_optimizer=False)
    config = chunks[0].module.config
    routers = [m for m in chunks[0].module.modules() if hasattr(m, "expert_bias")]
    gen = torch.Generator().manual_seed(0)

    def counts() -> list[torch.Tensor]:
        return [torch.randint(0, 50, m.local_tokens_per_expert.shape, generator=gen).to(
            m.local_tokens_per_expert.dtype) for m in routers]  # fmt: skip

    record: dict = {"routers": len(routers), "patched": site._update_router_expert_bias
                    is not originals["_update_router_expert_bias"]}  # fmt: skip
    for step in range(3):
        tokens = counts()
        start = [m.expert_bias.clone() for m in routers]
        results = {}
        for which, fn in (("original", originals["_update_router_expert_bias"]),
                          ("patched", site._update_router_expert_bias)):  # fmt: skip
            for m, t, b in zip(routers, tokens, start):
                m.local_tokens_per_expert.copy_(t)
                m.expert_bias.copy_(b)
            fn(chunks, config)
            results[which] = [m.expert_bias.clone() for m in routers]
        record[f"bias_equal_{step}"] = all(
            torch.equal(a, b) for a, b in zip(results["original"], results["patched"])
        )
        record[f"bias_moved_{step}"] = any(
            not torch.equal(a, b) for a, b in zip(results["patched"], start)
        )
        for m, t in zip(routers, tokens):
            m.local_tokens_per_expert.copy_(t)
        site.reset_model_temporary_tensors(config, chunks)
        record[f"reset_{step}"] = all(not m.local_tokens_per_expert.any() for m in routers)
    Path(out).write_text(json.dumps(record))


def test_cached_router_walks_match_megatron_core(tmp_path) -> None:
    out = tmp_path / "walks.json"
    spawn(_compare, 1, str(out))
    record = json.loads(out.read_text())
    assert record["patched"] and record["routers"] >= 2
    for step in range(3):
        assert record[f"bias_equal_{step}"] and record[f"bias_moved_{step}"]
        assert record[f"reset_{step}"]
