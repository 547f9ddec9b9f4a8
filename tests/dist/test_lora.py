"""Per-expert LoRA on megatron-core: the same adapters in every layout, the merged-weights
forward, only adapters train, PEFT save/load, scatter into another layout.

The single-process run of each tiny family is the reference: its gathered adapters,
adapter gradients and LoRA logits, and a merged HF checkpoint (W + scaling · B A).
Every layout must gather bit-identical adapters (same name-seeded initialisation),
give the merged model's logits, and (where data parallel is 1, so no gradient
reduction is involved) the reference's adapter gradients.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moerl.parallel import spawn

LOGIT_TOL = 1e-5
GRAD_TOL = 1e-5
B_STD = 0.05  # nonzero B: the adapter changes the output from the start
# (family, layout, check gradients, take a DDP optimizer step). Gradients are compared
# only where data parallel is 1; MLA under TP trains only with transformer-engine
# (moerl.trainer.wrap), so deepseek runs tp2 forward-only.
DEFAULT = [
    ("qwen3_moe", "tp2", True, False),
    ("deepseek_moe", "ep2", False, True),
    ("deepseek_moe", "pp2", True, False),
    ("qwen3_moe", "tp2ep2", False, False),
]
SLOW = [("deepseek_moe", "tp2", False, False), ("qwen3_moe", "ep2", False, True)]


def _lora_cfg():  # type: ignore[no-untyped-def]
    from moerl.config.lora import LoraConfig

    # every decoder linear and the output layer (named apart, as in PEFT)
    return LoraConfig(
        enabled=True, rank=4, alpha=8.0, seed=7, target_modules=["all-linear", "lm_head"]
    )


def _build(family: str, layout: str, hf_dir: str | Path):  # type: ignore[no-untyped-def]
    from moerl.convert import load_hf
    from moerl.models.gpt import build_model
    from moerl.models.tiny import tiny_config
    from moerl.parallel import parse_layout
    from moerl.parallel.state import initialize_for_model

    model = tiny_config(family)
    pcfg, _ = parse_layout(layout)
    initialize_for_model(pcfg, model, seed=5)
    chunks = build_model(model, pcfg)
    load_hf(chunks, hf_dir, model)
    return model, pcfg, chunks


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _backward(chunks, tokens: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """One forward/backward of a fixed linear function of the full logits."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = tokens.shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)

    def loss_func(output):  # type: ignore[no-untyped-def]
        logits = gather_from_tensor_model_parallel_region(output)
        weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
        return (logits * weight).sum() / logits.numel(), {}

    def forward_step(data, model):  # type: ignore[no-untyped-def]
        next(data)
        return model(tokens, position_ids, None), loss_func

    for chunk in chunks:
        chunk.train()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([0]),
        model=chunks,
        num_microbatches=1,
        seq_length=seq,
        micro_batch_size=batch,
        forward_only=False,
    )


def _train_step_touches_only_adapters(chunks, tokens: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    from moerl.lora import adapters
    from moerl.trainer.wrap import OptimConfig, build_optimizer, wrap_ddp

    ddp = wrap_ddp(chunks, use_distributed_optimizer=False)
    optimizer = build_optimizer(
        ddp, OptimConfig(lr=1e-2, clip_grad=0.0, use_distributed_optimizer=False)
    )
    lora = {id(p) for a in adapters(chunks) for p in a.parameters()}
    trainable = {id(p) for c in chunks for p in c.parameters() if p.requires_grad}
    assert trainable == lora
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == lora, "the optimizer must hold exactly the adapters"
    before = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    for chunk in ddp:
        chunk.zero_grad_buffer()
    _backward(ddp, tokens)
    for chunk in ddp:
        chunk.finish_grad_sync()
    with_grad = {
        id(p)
        for c in chunks
        for p in c.parameters()
        if p.requires_grad and p.main_grad.abs().sum() > 0
    }
    optimizer.step()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            changed = not torch.equal(before[name], param.detach())
            assert id(param) in lora or not changed, f"frozen {name} changed"
            assert changed or id(param) not in with_grad, f"adapter {name} did not move"
    assert len(with_grad) > 0.8 * len(lora), (len(with_grad), len(lora))


def _single(family: str, hf_dir: str, work: str) -> None:
    from safetensors.torch import save_file

    from moerl.checks.conversion import megatron_logits
    from moerl.lora import apply_lora, gather_adapters, merged_hf_state, peft_config
    from moerl.parallel.full_state import local_shards

    work_dir = Path(work)
    model, _, chunks = _build(family, "single", hf_dir)
    tokens = _tokens(model.vocab_size)
    base_logits = megatron_logits(chunks, tokens)
    cfg = _lora_cfg()
    keys = [s.key for s in local_shards(chunks)]
    count = apply_lora(chunks, cfg, model, b_std=B_STD)
    # conversion, weight export and checkpoints see the base model only
    assert [s.key for s in local_shards(chunks)] == keys
    assert count > model.num_layers * model.num_experts  # every routed expert has its own
    adapters = gather_adapters(chunks, model)
    experts = [n for n in adapters if ".mlp.experts." in n]
    assert len(experts) == 2 * 3 * model.num_experts * (model.num_layers - 1)
    logits = megatron_logits(chunks, tokens)
    assert (logits - base_logits).abs().max() > 1e-3, "the adapter must matter"
    _backward(chunks, tokens)
    grads = gather_adapters(chunks, model, grads=True)
    # group-limited routing may leave a few experts without tokens in this batch
    zero = [n for n, g in grads.items() if not g.abs().sum() > 0]
    assert all(".mlp.experts." in n for n in zero) and len(zero) < len(experts) // 4, zero
    save_file(adapters, str(work_dir / "adapters.safetensors"))
    save_file(grads, str(work_dir / "grads.safetensors"))
    torch.save(logits, work_dir / "logits.pt")

    config = peft_config(cfg, model, base_model_name_or_path=hf_dir)
    merged_dir = work_dir / "merged"
    merged_dir.mkdir()
    shutil.copy(Path(hf_dir) / "config.json", merged_dir / "config.json")
    merged = merged_hf_state(hf_dir, adapters, config)
    save_file(merged, str(merged_dir / "model.safetensors"), metadata={"format": "pt"})
    (work_dir / "peft_config.json").write_text(json.dumps(config))
    _check_merged(family, str(merged_dir), chunks, tokens)
    _train_step_touches_only_adapters(chunks, tokens)


def _check_merged(family: str, merged_dir: str, chunks, tokens: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """The LoRA forward equals the forward of the merged weights, in this layout."""
    from moerl.convert import load_hf
    from moerl.checks.conversion import megatron_logits
    from moerl.models.gpt import build_model
    from moerl.models.tiny import tiny_config

    model = tiny_config(family)
    pcfg = _layout_of(chunks)
    lora_logits = megatron_logits(chunks, tokens)
    plain = build_model(model, pcfg)
    load_hf(plain, merged_dir, model)
    merged_logits = megatron_logits(plain, tokens)
    if lora_logits is not None:
        diff = (lora_logits - merged_logits).abs().max().item()
        assert diff <= LOGIT_TOL, f"LoRA vs merged logits differ by {diff:.2e}"


def _layout_of(chunks):  # type: ignore[no-untyped-def]
    from moerl.config.parallel import ParallelConfig

    c = chunks[0].config
    return ParallelConfig(
        tp=c.tensor_model_parallel_size,
        pp=c.pipeline_model_parallel_size,
        ep=c.expert_model_parallel_size,
        etp=c.expert_tensor_parallel_size,
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _layout(family: str, layout: str, hf_dir: str, work: str, grads: bool, train: bool) -> None:
    from safetensors.torch import load_file

    from moerl.checks.conversion import megatron_logits
    from moerl.lora import apply_lora, gather_adapters, load_adapters_into

    work_dir = Path(work)
    model, _, chunks = _build(family, layout, hf_dir)
    apply_lora(chunks, _lora_cfg(), model, b_std=B_STD)
    ref = load_file(str(work_dir / "adapters.safetensors"))
    rank0 = dist.get_rank() == 0
    # (a) the same name-seeded adapters in every layout, bit for bit
    got = gather_adapters(chunks, model)
    if rank0:
        assert list(got) == list(ref)
        unequal = [n for n in ref if not torch.equal(got[n], ref[n])]
        assert not unequal, f"{len(unequal)} adapters differ from the single process: {unequal[:3]}"
    # (b) the LoRA forward equals the merged model's, and the single process's
    tokens = _tokens(model.vocab_size)
    logits = megatron_logits(chunks, tokens)
    if logits is not None:
        single = torch.load(work_dir / "logits.pt")
        assert (logits - single).abs().max() <= LOGIT_TOL
    _check_merged(family, str(work_dir / "merged"), chunks, tokens)
    # adapter gradients equal the single process's (TP/SP/expert-TP reductions are right)
    if grads:
        _backward(chunks, tokens)
        got_grads = gather_adapters(chunks, model, grads=True)
        if rank0:
            ref_grads = load_file(str(work_dir / "grads.safetensors"))
            worst = max((_rel(got_grads[n], g), n) for n, g in ref_grads.items())
            assert worst[0] <= GRAD_TOL, f"adapter gradient {worst[1]} off by {worst[0]:.2e}"
    # (d) scatter other full adapters into this layout: the gather gives them back exactly
    holder = [None]
    if rank0:
        gen = torch.Generator().manual_seed(3)
        # small, like trained adapters: large random ones saturate the routers, and the
        # train step below wants most experts to get tokens
        holder = [{n: 0.1 * torch.randn(t.shape, generator=gen) for n, t in ref.items()}]
    dist.broadcast_object_list(holder, src=0)
    other = holder[0]
    load_adapters_into(chunks, other)
    back = gather_adapters(chunks, model)
    if rank0:
        assert all(torch.equal(back[n], other[n]) for n in other)
    lacking = dict(other)
    del lacking[next(n for n in lacking if ".mlp.experts.5." in n)]
    with pytest.raises(KeyError, match="lacks"):
        load_adapters_into(chunks, lacking)
    again = gather_adapters(chunks, model)
    if rank0:  # a failed load wrote nothing
        assert all(torch.equal(again[n], other[n]) for n in other)
    if train:  # DDP (dense and expert buckets) and the optimizer see only adapters
        _train_step_touches_only_adapters(chunks, tokens)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family in ("deepseek_moe", "qwen3_moe"):
        work = tmp_path_factory.mktemp(f"lora-{family}")
        spawn(_single, 1, family, str(tiny_checkpoints[family]), str(work))
        out[family] = work
    return out


def test_single_process_reference(reference):
    """Built by the fixture: merged-weights forward, gradients on every adapter, and one
    optimizer step that moves only adapters (checked inside the worker)."""
    for work in reference.values():
        assert (work / "adapters.safetensors").is_file()


def _run_layout(family, layout, grads, train, reference, tiny_checkpoints):  # type: ignore[no-untyped-def]
    from moerl.parallel import parse_layout

    world = parse_layout(layout)[1]
    hf = str(tiny_checkpoints[family])
    spawn(_layout, world, family, layout, hf, str(reference[family]), grads, train)


@pytest.mark.parametrize("family, layout, grads, train", DEFAULT)
def test_layout(family, layout, grads, train, reference, tiny_checkpoints):
    _run_layout(family, layout, grads, train, reference, tiny_checkpoints)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout, grads, train", SLOW)
def test_layout_slow(family, layout, grads, train, reference, tiny_checkpoints):
    _run_layout(family, layout, grads, train, reference, tiny_checkpoints)


def test_peft_directory_roundtrip(reference, tmp_path):
    from safetensors.torch import load_file

    from moerl.lora import load_peft, merged_hf_state, save_peft

    work = reference["qwen3_moe"]
    tensors = load_file(str(work / "adapters.safetensors"))
    config = json.loads((work / "peft_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    )
    assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (128, 4)  # [vocab, r]
    path = save_peft(tmp_path / "adapter", tensors, config)
    back, back_config = load_peft(path)
    assert back_config == config and list(back) == list(tensors)
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    name = "base_model.model.model.layers.3.mlp.experts.7.down_proj.lora_B.weight"
    assert back[name].shape == (64, 4)  # B [out = hidden, r]
    with pytest.raises(ValueError, match="only one of"):
        merged_hf_state({}, {name: back[name]}, config)


# (family, layouts run one after the other in one group of processes, activation
# recompute, token batch shape, also the 'auto' mode and the Triton kernel): the grouped
# experts' LoRA against the per-expert one. tp2 has expert TP 2 (the all-reduced A and B
# gradients). The Triton interpreter takes one short sequence (some experts get none).
# 'full' recompute checks the adapters behind the frozen embedding still get gradients
# (megatron's reentrant checkpoint needs its input to require grad).
GROUPED = [
    ("deepseek_moe", ("single",), "full", (1, 8), True),
    ("qwen3_moe", ("ep2", "tp2"), "moe", (2, 16), False),
]


def _grouped_vs_per_expert(
    family: str, layout: str, hf_dir: str, recompute: str, shape: tuple[int, int], auto: bool
) -> None:
    from dataclasses import replace

    import moerl.lora.grouped as grouped
    from moerl.convert import load_hf
    from moerl.checks.conversion import megatron_logits
    from moerl.kernels.dispatch import backend
    from moerl.lora import apply_lora, gather_adapters, remove_lora
    from moerl.models.gpt import build_model
    from moerl.models.tiny import tiny_config
    from moerl.parallel import parse_layout
    from moerl.parallel.state import initialize_for_model

    model = tiny_config(family)
    pcfg, _ = parse_layout(layout)
    initialize_for_model(pcfg, model, seed=5)
    chunks = build_model(model, pcfg, recompute=recompute)
    load_hf(chunks, hf_dir, model)
    tokens = _tokens(model.vocab_size)[: shape[0], : shape[1]]
    calls = [0]
    kernel = grouped.lora_grouped

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return kernel(*args, **kwargs)

    grouped.lora_grouped = counted
    # 'auto' groups only where the Triton kernel runs: per expert under the torch backend
    runs = [("off", "torch"), ("on", "torch")]
    runs += [("auto", "torch"), ("auto", "triton")] if auto else []
    results = {}
    try:
        for mode, kernels in runs:
            apply_lora(chunks, replace(_lora_cfg(), grouped_experts=mode), model, b_std=B_STD)
            calls[0] = 0
            with backend(kernels):
                logits = megatron_logits(chunks, tokens)
                _backward(chunks, tokens)
            results[mode, kernels] = logits, gather_adapters(chunks, model, grads=True), calls[0]
            remove_lora(chunks)
    finally:
        grouped.lora_grouped = kernel
    moe_layers = model.num_layers - model.first_k_dense_replace
    # fc1 and fc2 once per MoE layer and forward: eval, train, and train's recompute
    grouped_calls = 2 * moe_layers * (3 if recompute != "none" else 2)
    ref_logits, ref_grads, _ = results["off", "torch"]
    if dist.get_rank() == 0:
        live = sum(bool(g.abs().sum() > 0) for g in ref_grads.values())
        assert live > 0.8 * len(ref_grads), f"only {live} of {len(ref_grads)} have gradients"
    for (mode, kernels), (logits, grads, count) in results.items():
        expected = grouped_calls if mode == "on" or kernels == "triton" else 0
        assert count == expected, (layout, mode, kernels, count, expected)
        if logits is not None:
            diff = (logits - ref_logits).abs().max().item()
            assert diff <= LOGIT_TOL, f"{layout} {mode}/{kernels}: logits differ by {diff:.2e}"
        if dist.get_rank() == 0:
            assert list(grads) == list(ref_grads)
            worst = max((_rel(grads[n], g), n) for n, g in ref_grads.items())
            assert worst[0] <= GRAD_TOL, (
                f"{layout} {mode}/{kernels}: {worst[1]} off by {worst[0]:.2e}"
            )


def _grouped(
    family: str,
    layouts: tuple[str, ...],
    hf_dir: str,
    recompute: str,
    shape: tuple[int, int],
    auto: bool,
) -> None:
    for layout in layouts:
        _grouped_vs_per_expert(family, layout, hf_dir, recompute, shape, auto)


@pytest.mark.parametrize("family, layouts, recompute, shape, auto", GROUPED)
def test_grouped_experts_match_per_expert(
    family, layouts, recompute, shape, auto, tiny_checkpoints
):
    """One grouped LoRA matmul per expert linear gives the per-expert logits and adapter
    gradients (the earlier adapters check its dx), under EP, expert TP and recompute;
    'auto' picks it exactly where the Triton kernel (here its interpreter) runs."""
    from moerl.parallel import parse_layout

    worlds = {parse_layout(layout)[1] for layout in layouts}
    assert len(worlds) == 1, layouts
    hf = str(tiny_checkpoints[family])
    spawn(_grouped, worlds.pop(), family, layouts, hf, recompute, shape, auto)


def test_grouped_experts_config():
    from moerl.config.lora import LoraConfig

    with pytest.raises(ValueError, match="grouped_experts='yes'"):
        LoraConfig(grouped_experts="yes").validate()
