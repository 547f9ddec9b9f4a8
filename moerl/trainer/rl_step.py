"""One RL optimizer step on rollouts: Keep Routing, sampling-mask replay, the IS
correction's weights and a policy loss, over megatron-core's schedules, DDP and optimizer.

Normalisation is global over the step: each micro-batch returns ``loss × units`` and its
unit count (response tokens for ``token_mean``, sequences otherwise), and megatron-core's
``calculate_per_token_loss`` divides the gradients by the units summed over micro-batches
and data-parallel ranks. Every layout therefore optimises the same objective.
"""

# B sequences per micro-batch, S padded length, T counted tokens of a micro-batch

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from moerl.algo.config import KLConfig
from moerl.algo.correction import CorrectionInput, CorrectionOutput
from moerl.algo.kl import KLInput, kl_term
from moerl.algo.losses import PolicyLossInput, PolicyLossOutput
from moerl.algo.offpolicy import loss_input
from moerl.algo.replay import is_none
from moerl.common.module_walk import modules_of
from moerl.common.trajectory import Trajectory
from moerl.compat import device_mode
from moerl.device import all_reduce_host
from moerl.trainer.batch import Advantage, MicroBatch, schedule_shape, step_microbatches
from moerl.trainer.fused_head import FusedHead, logprobs_of
from moerl.trainer.offpolicy import (
    OffPolicyBatch,
    check_weights,
    finite_metrics,
    mismatch_metrics,
)
from moerl.trainer.replay import RoutingReplay
from moerl.trainer.step import run_microbatches


@dataclass
class RLStepResult:
    loss: float | None  # the step's normalised objective (the last pipeline stage's)
    grad_norm: float | None
    metrics: dict[str, float] = field(default_factory=dict)


def _micro_loss(
    mb: MicroBatch,
    logits_BSV: torch.Tensor,
    *,
    loss_fn: Callable[[PolicyLossInput], PolicyLossOutput],
    old_policy: str,
    decoupled: bool,
    agg: str,
    use_mask: bool,
    current_version: int,
    kl: KLConfig | None = None,
    fused: bool = False,
    old_from_forward: bool = False,
    correction_fn: Callable[[CorrectionInput], CorrectionOutput] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    m = mb.loss_mask
    if not bool(m.any()):  # only padding rows (packed ranks with fewer sequences)
        return logits_BSV.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
    lp_T = logprobs_of(mb, logits_BSV, use_mask, fused)[m]
    behaviour_T = mb.sampling_logprobs[m]  # μ: over the kept set when the mask is replayed
    old_T = None if mb.old_logprobs is None else mb.old_logprobs[m]
    weights_T = None if mb.is_weights is None else mb.is_weights[m]
    seq_T = mb.seq_ids[m]
    n = len(mb.seq_index)
    counted_T = torch.ones_like(lp_T, dtype=torch.bool)
    extra: dict[str, Any] = {}
    if old_from_forward:  # π_old is this forward's π_θ, detached (one update per batch)
        old_T = lp_T.detach()
        if correction_fn is not None:
            weights_T, extra = _correct(correction_fn, mb, old_T, behaviour_T, current_version)
    inp = loss_input(
        old_policy=old_policy, decoupled=decoupled, logprobs_T=lp_T,
        behaviour_logprobs_T=behaviour_T, old_logprobs_T=old_T, weights_T=weights_T,
        advantages_T=mb.advantages[m], loss_mask_T=counted_T, seq_ids_T=seq_T, num_seqs=n,
    )  # fmt: skip
    out = loss_fn(inp)
    loss = out.loss
    if kl is not None and kl.coef > 0:
        if mb.ref_logprobs is None:
            raise ValueError("algo.kl.coef > 0 but the step has no reference logprobs")
        term = kl_term(
            KLInput(logprobs_T=lp_T, ref_logprobs_T=mb.ref_logprobs[m], loss_mask_T=counted_T,
                    seq_ids_T=seq_T, num_seqs=n, behaviour_logprobs_T=behaviour_T),
            kl,
        )  # fmt: skip
        loss, extra = loss + term.loss, {**extra, **term.metrics}
    units = int(m.sum()) if agg == "token_mean" else n
    metrics = {k: torch.tensor(float(v)) for k, v in {**out.metrics, **extra}.items()}
    metrics["loss"] = loss.detach()
    if mb.old_logprobs is None:  # no separate old-policy forward: the mismatch is
        # measured here (π_θ = π_old on the first minibatch's forward)
        metrics.update(
            mismatch_metrics(lp_T, behaviour_T, mb.versions[m], seq_T, n, current_version)
        )
    metrics["units"] = torch.tensor(float(units))
    return loss * units, torch.tensor(units, dtype=torch.int, device=loss.device), metrics


def _correct(
    correction_fn: Callable[[CorrectionInput], CorrectionOutput],
    mb: MicroBatch,
    old_T: torch.Tensor,
    behaviour_T: torch.Tensor,
    current_version: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The correction's weights of the micro-batch's trained tokens from π_old taken in
    this forward, computed as ``moerl.trainer.offpolicy.prepare`` computes them over the
    batch (float64 in, float32 weights out): its sequences are whole here, so a token-
    or sequence-level correction gives the same weights."""
    m = mb.loss_mask
    corr = correction_fn(
        CorrectionInput(
            trainer_logprobs_T=old_T.double(), rollout_logprobs_T=behaviour_T.double(),
            loss_mask_T=torch.ones(len(old_T), dtype=torch.bool, device=old_T.device),
            seq_ids_T=mb.seq_ids[m],
            num_seqs=len(mb.seq_index), versions_T=mb.versions[m],
            current_version=current_version, advantages_T=mb.advantages[m].double(),
        )
    )  # fmt: skip
    check_weights(corr.weights_T)
    return corr.weights_T.detach().to(torch.float32), dict(corr.metrics)


def _reduce_metrics(outputs: list[dict[str, torch.Tensor]], group: Any) -> dict[str, float]:
    """Unit-weighted means over micro-batches and DP ranks; keys ending in ``_max`` are
    maxima instead (a maximum that saw no token, -inf, is left out)."""
    names = sorted(outputs[0])
    maxima = [k for k in names if k.endswith("_max")]
    means = [k for k in names if k not in maxima and k != "units"]
    units = sum(float(o["units"]) for o in outputs)
    totals = torch.tensor(
        [units, *[sum(float(o[k]) * float(o["units"]) for o in outputs) for k in means]],
        dtype=torch.float64,
    )
    peaks = torch.tensor([max(float(o[k]) for o in outputs) for k in maxima], dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        totals = all_reduce_host(totals, group=group)
        if maxima:
            peaks = all_reduce_host(peaks, dist.ReduceOp.MAX, group)
    out = {k: float(totals[1 + i] / totals[0]) for i, k in enumerate(means)}
    out.update({k: float(peaks[i]) for i, k in enumerate(maxima)})
    return finite_metrics(out)


def _from_last_stage(metrics: dict[str, float]) -> dict[str, float]:
    """The last pipeline stage's metrics on every stage of its pipeline (rank 0, which
    writes metrics.jsonl, is on the first stage)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    box = [metrics]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]


def rl_train_step(
    chunks: list[Any],
    optimizer: Any,
    trajs: list[Trajectory],
    advantages: list[Advantage],
    *,
    loss_fn: Callable[[PolicyLossInput], PolicyLossOutput],
    offpolicy: OffPolicyBatch | None = None,
    old_policy: str = "rollout",
    decoupled: bool = False,
    agg: str = "token_mean",
    replay: Any = "all",
    use_mask: bool = True,
    micro_batch_size: int = 1,
    num_layers: int,
    topk: int,
    num_experts: int | None = None,
    current_version: int = 0,
    recent_window: int = 0,
    packing: str = "padded",
    pack_length: int = 0,
    step: bool = True,
    kl: KLConfig | None = None,
    ref_logprobs: list[Any] | None = None,
    logprobs_from: str = "logits",
    max_tokens: int = 0,
    old_from_forward: bool = False,
    correction_fn: Callable[[CorrectionInput], CorrectionOutput] | None = None,
) -> RLStepResult:
    """Forward/backward over every trajectory of ``trajs``, then one optimizer step.

    ``offpolicy`` carries π_old and the correction's weights per trajectory, computed over
    the whole rollout batch before its first update (moerl.trainer.offpolicy.prepare);
    ``old_policy``/``decoupled`` say how they compose with the loss
    (moerl.algo.offpolicy). Every rank returns the last pipeline stage's metrics.
    With ``kl`` (coef > 0), ``ref_logprobs`` holds each trajectory's reference-policy
    logprobs of its response tokens ([R] each) and ``kl``'s term joins the loss.
    ``logprobs_from='hidden'``: the output layer returns logprobs (``FusedHead``).
    ``old_from_forward``: π_old is this step's own forward, detached (valid when the batch
    takes one optimizer step), and ``correction_fn`` (if any) weights each micro-batch's
    tokens from it, so no separate old-policy forward runs; ``offpolicy`` is then None.
    ``max_tokens`` > 0 sizes micro-batches by padded tokens (``step_microbatches``)."""
    from megatron.core import parallel_state

    modules = [getattr(c, "module", c) for c in chunks]
    config = modules[0].config
    if not config.calculate_per_token_loss:
        raise ValueError(
            "the RL step normalises over the whole global batch: build the model with "
            "build_model(..., per_token_loss=True) before wrapping it in DDP"
        )
    mbs, seq_len = step_microbatches(
        config, trajs, micro_batch_size=micro_batch_size, use_routes=not is_none(replay),
        use_mask=use_mask, topk=topk, num_layers=num_layers, num_experts=num_experts,
        advantages=advantages, ref_logprobs=ref_logprobs, packing=packing,
        pack_length=pack_length, old_logprobs=offpolicy.old_logprobs if offpolicy else None,
        is_weights=offpolicy.is_weights if offpolicy else None, max_tokens=max_tokens,
    )  # fmt: skip
    rows, seq_len = schedule_shape(mbs)
    replayer = RoutingReplay(modules, policy=replay, recent_window=recent_window)
    chunk_of = {id(c): i for i, c in enumerate(chunks)}
    head = FusedHead(modules, use_mask) if logprobs_from == "hidden" else None
    loss_func = partial(
        _micro_loss, loss_fn=loss_fn, old_policy=old_policy, decoupled=decoupled, agg=agg,
        use_mask=use_mask, current_version=current_version, kl=kl, fused=head is not None,
        old_from_forward=old_from_forward, correction_fn=correction_fn,
    )  # fmt: skip

    def forward_step(data: Any, model: Any) -> tuple[Any, Any]:
        mb = next(data)
        if head is not None:
            head.set_microbatch(mb)
        replayer.set_microbatch(chunk_of[id(model)], mb.routes, mb.versions, current_version)
        output = model(
            mb.tokens, mb.position_ids, mb.attention_mask, padding_mask=mb.padding_mask(model)
        )
        return output, partial(loss_func, mb)

    for chunk in chunks:
        # a probe's forward may have left it in eval mode; train() on every module each
        # step (nn.Module's setattr, 170 modules) cost 0.6 ms of a tiny model's step
        if not all(m.training for m in modules_of(chunk)):
            chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = run_microbatches(
        chunks, forward_step, mbs, seq_length=seq_len, micro_batch_size=rows,
        forward_only=False, head=head,
    )  # fmt: skip
    replayer.finish()
    replay_metrics = replayer.metrics()  # collective: every rank, every step
    grad_norm = optimizer.step()[1] if step else None
    outputs = [o for o in outputs or [] if o]  # padding-only micro-batches report nothing
    metrics: dict[str, float] = {}
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and outputs:
        with device_mode.suspended():  # host floats and tensors only: no CUDA device named
            metrics = _reduce_metrics(outputs, parallel_state.get_data_parallel_group())
    metrics = {**_from_last_stage(metrics), **replay_metrics}
    return RLStepResult(loss=metrics.get("loss"), grad_norm=grad_norm, metrics=metrics)
