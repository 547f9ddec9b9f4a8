"""One RL step (Keep Routing + sampling mask + IS correction + PPO) on engine rollouts:
every layout optimises the same objective, and on-policy IS weights are 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moerl.parallel import parse_layout, spawn
from moerl.checks.replay import collect_rollouts


def _reward(t) -> float:  # type: ignore[no-untyped-def]
    """A verifiable toy reward: the fraction of even token ids in the response."""
    return float(np.mean(t.response_ids % 2 == 0))


def _step(
    layout: str, hf_dir: str, rollouts: str, out: str, family: str = "deepseek_moe",
    recompute: str = "none", name: str | None = None, packing: str = "padded",
    logprobs_from: str = "logits", kernels: str = "auto", lora: bool = False,
    objective: dict | None = None,
) -> None:  # fmt: skip
    """One RL step (gradients and metrics saved). ``objective`` overrides the default
    ppo_clip + tis under old_policy=recompute: keys loss, correction, old_policy, and
    behaviour_noise (std of noise added to the rollouts' logprobs μ, seeded)."""
    from moerl.algo.advantages import AdvantageInput, build_advantage
    from moerl.algo.correction import build_correction
    from moerl.algo.losses import build_policy_loss
    from moerl.convert import HFCheckpoint, load_hf
    from moerl.kernels.dispatch import set_backend
    from moerl.models import get_family
    from moerl.models.gpt import build_model
    from moerl.parallel.full_state import gather_full
    from moerl.parallel.state import initialize_model_parallel
    from moerl.common.trajectory import load_jsonl
    from moerl.trainer.forward import trainer_logprobs
    from moerl.trainer.offpolicy import prepare
    from moerl.trainer.rl_step import rl_train_step
    from moerl.trainer.wrap import OptimConfig, attach_schedule_hooks, build_optimizer, wrap_ddp

    set_backend(kernels)
    model = get_family(family).from_hf(HFCheckpoint(hf_dir).config())
    pcfg, _ = parse_layout(layout)
    initialize_model_parallel(
        pcfg,
        num_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        num_experts=model.num_experts,
    )
    chunks = build_model(model, pcfg, routing_replay=True, per_token_loss=True, recompute=recompute)
    load_hf(chunks, hf_dir, model)
    if lora:  # adapters on lm_head too (folded into the fused head), B nonzero
        from moerl.config.lora import LoraConfig
        from moerl.lora import apply_lora

        cfg = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["o_proj", "lm_head"])
        apply_lora(chunks, cfg, model, b_std=0.05)
    ddp = wrap_ddp(chunks, use_distributed_optimizer=True)
    optimizer = build_optimizer(ddp, OptimConfig(lr=1e-3, adam_eps=1e-6))
    attach_schedule_hooks(ddp, optimizer)
    opts = {"loss": "ppo_clip", "correction": "tis", "old_policy": "recompute",
            "behaviour_noise": 0.0, **(objective or {})}  # fmt: skip
    trajs = load_jsonl(rollouts)
    rng = np.random.default_rng(0)
    for t in trajs:  # μ away from the trainer's π_old: IS weights ≠ 1, some truncated
        eps = (opts["behaviour_noise"] * rng.normal(size=t.response_len)).astype(np.float32)
        t.response_logprobs = t.response_logprobs + eps
        if t.sampling_logprobs is not None:
            t.sampling_logprobs = t.sampling_logprobs + eps
    rewards = torch.tensor([_reward(t) for t in trajs])
    adv = build_advantage("reinforce_pp")(
        AdvantageInput(rewards_S=rewards, group_ids_S=torch.arange(len(trajs)))
    )
    batching = dict(
        num_layers=model.num_layers, topk=model.moe_router_topk, num_experts=model.num_experts,
        packing=packing, pack_length=64, micro_batch_size=2 if packing == "packed" else 1,
        logprobs_from=logprobs_from,
    )  # fmt: skip
    old = trainer_logprobs(ddp, trajs, **batching)
    offpolicy = prepare(
        trajs, adv.advantages_S.tolist(), old_logprobs=[old.logprobs[i] for i in range(len(trajs))],
        correction_fn=build_correction(opts["correction"]), use_mask=True, current_version=0,
    )  # fmt: skip
    result = rl_train_step(
        ddp, optimizer, trajs, adv.advantages_S.tolist(), loss_fn=build_policy_loss(opts["loss"]),
        offpolicy=offpolicy, old_policy=opts["old_policy"], step=False, **batching,
    )  # fmt: skip
    result.metrics = {**offpolicy.metrics, **result.metrics}
    from moerl.parallel.full_state import allgather_sharded_grads

    allgather_sharded_grads(ddp)
    if lora:  # the adapters' gradients, gathered to full PEFT tensors
        from moerl.lora import gather_adapters

        grad_tensors = gather_adapters([c.module for c in ddp], model, grads=True)
    else:
        full = gather_full([c.module for c in ddp], "grad")  # None off rank 0
        grad_tensors = full.tensors if full is not None else {}
    result.grad_norm = optimizer.step()[1]
    params = gather_full([c.module for c in ddp], "param")
    results: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        results,
        ({**result.metrics, "grad_norm": float(result.grad_norm)} if result.metrics else None),
    )
    if dist.get_rank() == 0:
        name = name or layout
        metrics = next(r for r in results if r)
        torch.save(params.tensors, Path(out) / f"{name}.pt")
        torch.save(grad_tensors, Path(out) / f"{name}.grad.pt")
        (Path(out) / f"{name}.json").write_text(json.dumps(metrics))


@pytest.fixture(scope="module")
def rollouts(tiny_checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "r.jsonl"
    collect_rollouts(
        tiny_checkpoints["deepseek_moe"], path, num_prompts=8, max_new_tokens=12, dtype="float32"
    )
    return tiny_checkpoints["deepseek_moe"], path


def test_rl_step_same_objective_in_every_layout(rollouts, tmp_path):
    """ep2 (data + expert parallel, distributed optimizer) against one process. The
    DeepSeek model uses MLA, which is refused under TP without transformer-engine
    (see test_mla_training_under_tp_needs_te)."""
    hf, path = rollouts
    for layout in ("single", "ep2"):
        spawn(_step, parse_layout(layout)[1], layout, str(hf), str(path), str(tmp_path))
    ref, got = (json.loads((tmp_path / f"{x}.json").read_text()) for x in ("single", "ep2"))
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    # fresh fp32 rollouts: on-policy, so the IS correction is the identity
    assert ref["mismatch/log_ratio_abs_max"] < 1e-5
    weight_keys = [k for k in ref if "weight" in k and "mean" in k]
    assert weight_keys and all(abs(ref[k] - 1.0) < 1e-4 for k in weight_keys)
    ga, gb = torch.load(tmp_path / "single.grad.pt"), torch.load(tmp_path / "ep2.grad.pt")
    for key in ga:  # gradients of the RL objective, gathered to full shape
        err = (ga[key] - gb[key]).norm() / ga[key].norm()
        assert err < 1e-5, (key, float(err))
    a, b = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "ep2.pt")
    for key in a:
        err = (a[key] - b[key]).norm() / a[key].norm()
        assert err < 1e-5, (key, float(err))


def _shifted_routes(src: Path, dst: Path, num_experts: int) -> None:
    """Rollouts whose recorded routes differ from what the router would choose (each
    expert id shifted by one): replay then changes the forward, so a recompute that
    routed freshly would give different gradients."""
    from moerl.common.trajectory import load_jsonl, save_jsonl

    trajs = load_jsonl(src)
    for t in trajs:
        t.routed_experts = (np.asarray(t.routed_experts) + 1) % num_experts
    save_jsonl(dst, trajs)


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_recompute_replays_the_forward_routes(rollouts, tmp_path):
    """Activation recompute (full, and MoE-only under ep2) re-runs the router inside
    backward; replay must hand it the forward's routes, so gradients equal the run
    without recompute."""
    from moerl.convert import HFCheckpoint
    from moerl.models import get_family

    hf, path = rollouts
    experts = get_family("deepseek_moe").from_hf(HFCheckpoint(hf).config()).num_experts
    shifted = tmp_path / "shifted.jsonl"
    _shifted_routes(path, shifted, experts)
    runs = [("single", "none", "plain"), ("single", "full", "full"), ("ep2", "moe", "moe")]
    for layout, recompute, name in runs:
        spawn(_step, parse_layout(layout)[1], layout, str(hf), str(shifted), str(tmp_path),
              "deepseek_moe", recompute, name)  # fmt: skip
    ref = torch.load(tmp_path / "plain.grad.pt")
    for name in ("full", "moe"):
        got = torch.load(tmp_path / f"{name}.grad.pt")
        for key in ref:
            err = (ref[key] - got[key]).norm() / ref[key].norm()
            assert err < 1e-5, (name, key, float(err))


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_packed_rows_give_the_padded_objective(rollouts, tmp_path):
    """Sequences packed several to a row (block-diagonal attention, routes and masks at
    their packed offsets) optimise the same objective as one sequence per row, on one
    process and under ep2 (where ranks pack different numbers of rows)."""
    hf, path = rollouts
    runs = [("single", "padded"), ("single", "packed"), ("ep2", "packed")]
    for layout, packing in runs:
        spawn(_step, parse_layout(layout)[1], layout, str(hf), str(path), str(tmp_path),
              "deepseek_moe", "none", f"{layout}-{packing}", packing)  # fmt: skip
    ref = json.loads((tmp_path / "single-padded.json").read_text())
    grads = torch.load(tmp_path / "single-padded.grad.pt")
    for name in ("single-packed", "ep2-packed"):
        got = json.loads((tmp_path / f"{name}.json").read_text())
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7), name
        assert got["mismatch/log_ratio_abs_max"] < 1e-5  # on-policy with packing too
        other = torch.load(tmp_path / f"{name}.grad.pt")
        for key in grads:
            err = (grads[key] - other[key]).norm() / grads[key].norm()
            assert err < 1e-5, (name, key, float(err))


def _mla_tp(hf_dir: str) -> None:
    from moerl.convert import HFCheckpoint
    from moerl.models import get_family
    from moerl.models.gpt import build_model
    from moerl.parallel.state import initialize_model_parallel
    from moerl.trainer.wrap import wrap_ddp

    model = get_family("deepseek_moe").from_hf(HFCheckpoint(hf_dir).config())
    pcfg, _ = parse_layout("tp2")
    initialize_model_parallel(
        pcfg,
        num_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_experts=model.num_experts,
    )
    chunks = build_model(model, pcfg)
    with pytest.raises(ValueError, match="needs transformer-engine"):
        wrap_ddp(chunks, use_distributed_optimizer=True)


def test_mla_training_under_tp_needs_te(tiny_checkpoints):
    spawn(_mla_tp, 2, str(tiny_checkpoints["deepseek_moe"]))


def _compare(tmp_path: Path, ref_name: str, got_name: str) -> None:
    ref, got = (json.loads((tmp_path / f"{x}.json").read_text()) for x in (ref_name, got_name))
    assert ref["mismatch/log_ratio_abs_max"] < 1e-5
    ga, gb = (
        torch.load(tmp_path / f"{ref_name}.grad.pt"),
        torch.load(tmp_path / f"{got_name}.grad.pt"),
    )
    for key in ga:
        err = (ga[key] - gb[key]).norm() / ga[key].norm()
        assert err < 1e-5, (key, float(err))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2ep2", "pp2"])
def test_rl_step_gqa_family_under_tp_and_pp(layout, tiny_checkpoints, tmp_path):
    """Qwen3-MoE (GQA with q/k norm): the RL step under TP (sequence parallel) and PP."""
    hf = tiny_checkpoints["qwen3_moe"]
    path = tmp_path / "r.jsonl"
    collect_rollouts(hf, path, num_prompts=8, max_new_tokens=12, dtype="float32")
    for name in ("single", layout):
        spawn(_step, parse_layout(name)[1], name, str(hf), str(path), str(tmp_path), "qwen3_moe")
    _compare(tmp_path, "single", layout)


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_fused_head_gives_the_logits_objective(rollouts, tmp_path):
    """trainer.logprobs_from=hidden (the output layer returns logprobs; logits never
    whole) optimises the same objective as logprobs from logits: loss and every gradient,
    on one process with the torch twin and with the Triton kernel (CPU interpreter), and
    with an lm_head LoRA adapter folded into the head."""
    hf, path = rollouts
    runs = [
        ("logits", "auto", False, "logits"),
        ("hidden", "auto", False, "hidden"),
        ("hidden", "triton", False, "hidden-triton"),
        ("logits", "auto", True, "lora-logits"),
        ("hidden", "auto", True, "lora-hidden"),
    ]
    for source, kernels, lora, name in runs:
        spawn(_step, 1, "single", str(hf), str(path), str(tmp_path), "deepseek_moe", "none",
              name, "padded", source, kernels, lora)  # fmt: skip
    for ref, got in [
        ("logits", "hidden"),
        ("logits", "hidden-triton"),
        ("lora-logits", "lora-hidden"),
    ]:
        a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in (ref, got))
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), got
        # same logprobs (the base runs are on-policy: the rollouts' own model)
        assert b["mismatch/log_ratio_abs_max"] == pytest.approx(
            a["mismatch/log_ratio_abs_max"], rel=1e-4, abs=1e-5
        )
        assert "lora" in got or b["mismatch/log_ratio_abs_max"] < 1e-5
        ga, gb = torch.load(tmp_path / f"{ref}.grad.pt"), torch.load(tmp_path / f"{got}.grad.pt")
        assert set(ga) == set(gb) and ga
        for key in ga:
            err = (ga[key] - gb[key]).norm() / ga[key].norm().clamp_min(1e-30)
            assert err < 1e-5, (got, key, float(err))
    lora_grads = torch.load(tmp_path / "lora-hidden.grad.pt")
    assert lora_grads["base_model.model.lm_head.lora_A.weight"].abs().sum() > 0


@pytest.mark.slow
def test_fused_head_under_tensor_parallelism(tiny_checkpoints, tmp_path):
    """The fused head under TP with sequence parallelism (Qwen3-MoE, tp2ep2: vocabulary
    shards, the gathered input's reduce-scatter) equals one process's logits path."""
    hf = tiny_checkpoints["qwen3_moe"]
    path = tmp_path / "r.jsonl"
    collect_rollouts(hf, path, num_prompts=8, max_new_tokens=12, dtype="float32")
    spawn(_step, 1, "single", str(hf), str(path), str(tmp_path), "qwen3_moe")
    spawn(_step, 4, "tp2ep2", str(hf), str(path), str(tmp_path), "qwen3_moe", "none",
          "tp-hidden", "padded", "hidden")  # fmt: skip
    _compare(tmp_path, "single", "tp-hidden")


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_recompute_weights_the_gradient_once(rollouts, tmp_path):
    """ppo_clip + tis with old_policy=recompute, first optimizer step of a batch whose
    behaviour logprobs μ sit away from the trainer (noise, so weights ≠ 1 and some are
    truncated): every parameter's gradient equals REINFORCE's with the weight
    min(π_old/μ, C), i.e. the per-token gradient min(π_old/μ, C)·A·∇log π. The former
    composition (ratio against μ, the correction on top) does not."""
    hf, path = rollouts
    runs = {
        "rc-ppo": {"loss": "ppo_clip"},
        "rc-reinforce": {"loss": "reinforce"},
        "former": {"loss": "ppo_clip", "old_policy": "rollout"},
    }
    for name, objective in runs.items():
        spawn(_step, 1, "single", str(hf), str(path), str(tmp_path), "deepseek_moe", "none",
              name, "padded", "logits", "auto", False, {**objective, "behaviour_noise": 1.0})  # fmt: skip
    metrics = json.loads((tmp_path / "rc-ppo.json").read_text())
    assert metrics["is/clipped_frac"] > 0.1 and metrics["mismatch/mean_abs_dlogp"] > 0.5
    assert metrics["loss/ratio_max"] == pytest.approx(1.0, abs=1e-5)  # r = π_θ/π_old
    ppo, reinforce, former = (torch.load(tmp_path / f"{n}.grad.pt") for n in runs)
    far = 0
    for key in ppo:
        scale = reinforce[key].norm().clamp_min(1e-30)
        assert (ppo[key] - reinforce[key]).norm() / scale < 1e-5, key
        far += bool((former[key] - reinforce[key]).norm() / scale > 1e-2)
    assert far > len(ppo) // 2
