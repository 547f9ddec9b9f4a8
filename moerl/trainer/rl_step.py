"""One RL optimizer step on rollouts: Keep Routing, sampling-mask replay, an IS
correction and a policy loss, over megatron-core's schedules, DDP and optimizer.

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
from moerl.rollout.trajectory import Trajectory
from moerl.trainer.batch import MicroBatch, step_microbatches
from moerl.trainer.fused_head import FusedHead, logprobs_of
from moerl.trainer.replay import RoutingReplay
from moerl.trainer.step import run_microbatches


@dataclass
class RLStepResult:
    loss: float | None  # on the last pipeline stage: the step's normalised objective
    grad_norm: float | None
    metrics: dict[str, float] = field(default_factory=dict)


def _micro_loss(
    mb: MicroBatch,
    logits_BSV: torch.Tensor,
    *,
    loss_fn: Callable[[PolicyLossInput], PolicyLossOutput],
    correction_fn: Callable[[CorrectionInput], CorrectionOutput],
    agg: str,
    use_mask: bool,
    current_version: int,
    kl: KLConfig | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    m = mb.loss_mask
    if not bool(m.any()):  # only padding rows (packed ranks with fewer sequences)
        return logits_BSV.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
    lp_BS = logprobs_of(mb, logits_BSV, use_mask, fused)
    lp_T = lp_BS[m]
    old_T = (mb.sampling_logprobs if use_mask else mb.rollout_logprobs)[m]
    adv_T = mb.advantages[m]
    seq_T = mb.seq_ids[m]
    n = len(mb.seq_index)
    counted_T = torch.ones_like(lp_T, dtype=torch.bool)
    corr = correction_fn(
        CorrectionInput(
            trainer_logprobs_T=lp_T.detach(), rollout_logprobs_T=old_T, loss_mask_T=counted_T,
            seq_ids_T=seq_T, num_seqs=n, versions_T=mb.versions[m],
            current_version=current_version, advantages_T=adv_T,
        )
    )  # fmt: skip
    out = loss_fn(
        PolicyLossInput(
            logprobs_T=lp_T, old_logprobs_T=old_T, advantages_T=adv_T, loss_mask_T=counted_T,
            seq_ids_T=seq_T, num_seqs=n, is_weights_T=corr.weights_T,
        )
    )  # fmt: skip
    loss, extra = out.loss, {}
    if kl is not None and kl.coef > 0:
        if mb.ref_logprobs is None:
            raise ValueError("algo.kl.coef > 0 but the step has no reference logprobs")
        term = kl_term(
            KLInput(logprobs_T=lp_T, ref_logprobs_T=mb.ref_logprobs[m], loss_mask_T=counted_T,
                    seq_ids_T=seq_T, num_seqs=n),
            kl,
        )  # fmt: skip
        loss, extra = loss + term.loss, term.metrics
    units = int(m.sum()) if agg == "token_mean" else n
    metrics = {
        k: torch.tensor(float(v)) for k, v in {**corr.metrics, **out.metrics, **extra}.items()
    }
    metrics["loss"] = loss.detach()
    d_T = lp_T.detach().double() - old_T.double()
    metrics["mismatch/k3"] = (torch.expm1(d_T) - d_T).mean().float()
    gap_T = (current_version - mb.versions[m]).float()
    metrics["staleness/mean"] = gap_T.mean()
    metrics["staleness/stale_frac"] = (gap_T > 0).float().mean()
    metrics["mismatch/log_ratio_abs_max"] = (lp_T.detach() - old_T).abs().max()
    metrics["mismatch/mean_abs_dlogp"] = (lp_T.detach() - old_T).abs().mean()
    # sequences sampled entirely by the current policy: with replay and mask in fp32 their
    # log ratio is numerics only (the on-policy anchor check, step after step)
    stale_S = torch.zeros(n).index_add_(0, seq_T, (gap_T > 0).float()) > 0
    onpolicy_T = ~stale_S[seq_T]
    metrics["mismatch/onpolicy_log_ratio_abs_max"] = (
        (lp_T.detach() - old_T)[onpolicy_T].abs().max()
        if bool(onpolicy_T.any())
        else torch.tensor(0.0)
    )
    metrics["mismatch/onpolicy_frac"] = onpolicy_T.float().mean()
    metrics["units"] = torch.tensor(float(units))
    return loss * units, torch.tensor(units, dtype=torch.int), metrics


def _reduce_metrics(outputs: list[dict[str, torch.Tensor]], group: Any) -> dict[str, float]:
    """Unit-weighted means over micro-batches and DP ranks; keys ending in ``_max`` are
    maxima instead."""
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
        dist.all_reduce(totals, group=group)
        if maxima:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    out = {k: float(totals[1 + i] / totals[0]) for i, k in enumerate(means)}
    out.update({k: float(peaks[i]) for i, k in enumerate(maxima)})
    return out


def rl_train_step(
    chunks: list[Any],
    optimizer: Any,
    trajs: list[Trajectory],
    advantages: list[float],
    *,
    loss_fn: Callable[[PolicyLossInput], PolicyLossOutput],
    correction_fn: Callable[[CorrectionInput], CorrectionOutput],
    agg: str = "token_mean",
    replay: str = "all",
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
) -> RLStepResult:
    """Forward/backward over every trajectory of the global batch, then one optimizer step.

    With ``kl`` (coef > 0), ``ref_logprobs`` holds each trajectory's reference-policy
    logprobs of its response tokens ([R] each) and ``kl``'s term joins the loss.
    ``logprobs_from='hidden'``: the output layer returns logprobs (``FusedHead``)."""
    from megatron.core import parallel_state

    modules = [getattr(c, "module", c) for c in chunks]
    config = modules[0].config
    if not config.calculate_per_token_loss:
        raise ValueError(
            "the RL step normalises over the whole global batch: build the model with "
            "build_model(..., per_token_loss=True) before wrapping it in DDP"
        )
    mbs, seq_len = step_microbatches(
        config, trajs, micro_batch_size=micro_batch_size, use_routes=replay != "none",
        use_mask=use_mask, topk=topk, num_layers=num_layers, num_experts=num_experts,
        advantages=advantages, ref_logprobs=ref_logprobs, packing=packing,
        pack_length=pack_length,
    )  # fmt: skip
    replayer = RoutingReplay(modules, policy=replay, recent_window=recent_window)
    chunk_of = {id(c): i for i, c in enumerate(chunks)}
    head = FusedHead(modules, use_mask) if logprobs_from == "hidden" else None
    loss_func = partial(
        _micro_loss, loss_fn=loss_fn, correction_fn=correction_fn, agg=agg,
        use_mask=use_mask, current_version=current_version, kl=kl, fused=head is not None,
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
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = run_microbatches(
        chunks, forward_step, mbs, seq_length=seq_len, micro_batch_size=micro_batch_size,
        forward_only=False, head=head,
    )  # fmt: skip
    replayer.finish()
    grad_norm = optimizer.step()[1] if step else None
    result = RLStepResult(loss=None, grad_norm=grad_norm)
    outputs = [o for o in outputs or [] if o]  # padding-only micro-batches report nothing
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and outputs:
        result.metrics = _reduce_metrics(outputs, parallel_state.get_data_parallel_group())
        result.loss = result.metrics["loss"]
    return result
