"""Trainer-side logprobs of rollouts (forward only), with routing replay and the
sampling mask, plus the router flip rate of a fresh (non-replayed) forward.

This is the measurement behind the IS-ratio check (fresh on-policy rollouts must give
ratio 1), the mismatch telemetry and ``tools/check_replay.py``.
"""

# B sequences, S padded length, L layers, K top-k

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moerl.algo.replay import is_none
from moerl.common.trajectory import Trajectory
from moerl.device import all_reduce_host
from moerl.trainer.batch import MicroBatch, schedule_shape, step_microbatches
from moerl.trainer.fused_head import FusedHead, logprobs_of
from moerl.trainer.replay import RoutingReplay
from moerl.trainer.step import run_microbatches


@dataclass
class LogprobResult:
    logprobs: dict[int, np.ndarray] = field(default_factory=dict)  # trajectory → [R]
    flips_L: np.ndarray | None = (
        None  # per layer: tokens whose top-k set differs from the rollout's
    )
    tokens_L: np.ndarray | None = None  # per layer: tokens compared

    def flip_rate(self) -> np.ndarray:
        if self.flips_L is None or self.tokens_L is None:
            return np.zeros(0)
        return self.flips_L / np.maximum(self.tokens_L, 1)


def _count_flips(
    used_TK: torch.Tensor, want_TK: torch.Tensor, valid_T: torch.Tensor
) -> tuple[int, int]:
    """Tokens (of ``valid_T``) whose routed expert *set* differs (order does not count)."""
    a, _ = torch.sort(used_TK.long(), dim=-1)
    b, _ = torch.sort(want_TK.long(), dim=-1)
    differ = (a != b).any(dim=-1) & valid_T
    return int(differ.sum()), int(valid_T.sum())


def trainer_logprobs(
    chunks: list[Any],
    trajs: list[Trajectory],
    *,
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
    max_tokens: int = 0,
    logprobs_from: str = "logits",
) -> LogprobResult:
    """Forward every trajectory once; rank 0 returns the logprobs of all response tokens
    and the per-layer flip counts (the routes the trainer used vs the rollout's)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    config = getattr(chunks[0], "module", chunks[0]).config
    mbs, seq_len = step_microbatches(
        config, trajs, micro_batch_size=micro_batch_size, use_routes=None if is_none(replay) else True,
        use_mask=use_mask, topk=topk, num_layers=num_layers, num_experts=num_experts,
        packing=packing, pack_length=pack_length, max_tokens=max_tokens,
    )  # fmt: skip
    rows, seq_len = schedule_shape(mbs)
    replayer = RoutingReplay(chunks, policy=replay, recent_window=recent_window)
    flips = np.zeros(num_layers, dtype=np.int64)
    counts = np.zeros(num_layers, dtype=np.int64)
    result = LogprobResult()
    chunk_of = {id(c): i for i, c in enumerate(chunks)}

    def loss_func(mb: MicroBatch, logits_BSV: torch.Tensor) -> tuple[torch.Tensor, dict]:
        lp = logprobs_of(mb, logits_BSV, use_mask, head is not None)
        for i, index in enumerate(mb.seq_index):
            response = mb.loss_mask if mb.response_mask is None else mb.response_mask
            mine = (mb.seq_ids == i) & response
            result.logprobs[index] = lp[mine].detach().cpu().numpy().copy()
        return logits_BSV.sum() * 0.0, {}

    modules = [getattr(c, "module", c) for c in chunks]
    head = FusedHead(modules, use_mask) if logprobs_from == "hidden" else None

    def forward_step(data: Any, model: Any) -> tuple[Any, Any]:
        mb = next(data)
        if head is not None:
            head.set_microbatch(mb)
        chunk = chunk_of[id(model)]
        if is_none(replay):
            for inst in replayer.layers[chunk].values():
                inst.set_router_replay_action(RouterReplayAction.RECORD)
        else:
            replayer.set_microbatch(chunk, mb.routes, mb.versions, current_version)
        output = model(
            mb.tokens, mb.position_ids, mb.attention_mask, padding_mask=mb.padding_mask(model)
        )
        if mb.routes is not None:
            valid = replayer._local(mb.valid())
            want = replayer._local(mb.routes)
            for number, inst in replayer.layers[chunk].items():
                used = inst.get_recorded_indices() if is_none(replay) else inst.moerl_used
                f, n = _count_flips(used, want[:, number - 1], valid)
                flips[number - 1] += f
                counts[number - 1] += n
        return output, partial(loss_func, mb)

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        run_microbatches(
            chunks, forward_step, mbs, seq_length=seq_len, micro_batch_size=rows,
            forward_only=True, head=head,
        )  # fmt: skip
    replayer.finish()  # with replay='none' nothing was targeted; it just clears RECORD state

    totals = torch.from_numpy(np.stack([flips, counts]))
    if dist.is_initialized() and dist.get_world_size() > 1:
        # each (layer, token) lives on exactly one rank: PP splits layers, SP/DP split tokens;
        # TP ranks without SP and EP see the same tokens, so count them once (TP rank 0)
        if parallel_state.get_tensor_model_parallel_rank() != 0 and not config.sequence_parallel:
            totals.zero_()
        totals = all_reduce_host(totals)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result.logprobs if last_stage else {})
        merged: dict[int, np.ndarray] = {}
        for part in gathered:
            merged.update(part)
        result.logprobs = merged
    result.flips_L, result.tokens_L = totals[0].numpy(), totals[1].numpy()
    return result
