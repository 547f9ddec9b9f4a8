"""Trajectories → padded micro-batches for this data-parallel rank.

Each trajectory trains on its P+R−1 input tokens (prompt + response without the last
token), predicting tokens 1..P+R−1; the engine's routed-experts rows are exactly one
per input token (SGLang's convention), so routes need no padding. Sequences are padded
to one length per step (a multiple of TP, for sequence parallelism) so pipeline stages
exchange fixed shapes. Tokens are flattened batch-major: index = b · S + s.
"""

# B sequences per micro-batch, S padded length, L layers, K top-k, N kept (pos, id) pairs

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moerl.rollout.trajectory import Trajectory


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # int64 [B, S]
    labels: torch.Tensor  # int64 [B, S]
    position_ids: torch.Tensor  # int64 [B, S]
    loss_mask: torch.Tensor  # bool [B, S]: the position predicts a response token
    rollout_logprobs: torch.Tensor  # fp32 [B, S] engine logprob (full vocabulary)
    sampling_logprobs: torch.Tensor  # fp32 [B, S] engine logprob over the kept set (or = rollout)
    versions: torch.Tensor  # int64 [B, S] policy version of each predicted token
    temperature: torch.Tensor  # fp32 [B·S]
    advantages: torch.Tensor  # fp32 [B, S]
    routes: torch.Tensor | None  # int64 [B, S, L, K]
    mask_pos: torch.Tensor | None  # int64 [N] flattened token index
    mask_ids: torch.Tensor | None  # int64 [N]
    seq_index: list[int]  # which trajectories (indices into the step's list)
    lengths: torch.Tensor  # int64 [B] input tokens per sequence (the rest is padding)

    def valid(self) -> torch.Tensor:
        """bool [B, S]: real (non-padding) input tokens."""
        return self.position_ids < self.lengths[:, None]

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def padded_length(trajs: list[Trajectory], multiple: int) -> int:
    longest = max(t.prompt_len + t.response_len - 1 for t in trajs)
    return -(-longest // multiple) * multiple


def build_microbatch(
    trajs: list[Trajectory],
    seq_index: list[int],
    seq_len: int,
    *,
    topk: int = 0,
    num_layers: int = 0,
    num_experts: int | None = None,
    use_routes: bool = False,
    use_mask: bool = False,
    advantages: list[float] | None = None,
) -> MicroBatch:
    b = len(trajs)
    tokens = torch.zeros(b, seq_len, dtype=torch.long)
    labels = torch.zeros(b, seq_len, dtype=torch.long)
    loss_mask = torch.zeros(b, seq_len, dtype=torch.bool)
    rollout = torch.zeros(b, seq_len)
    sampling = torch.zeros(b, seq_len)
    versions = torch.zeros(b, seq_len, dtype=torch.long)
    temperature = torch.ones(b, seq_len)
    adv = torch.zeros(b, seq_len)
    routes = None
    if use_routes:
        # Padding positions route to experts 0..K-1 (valid, distinct); they carry no loss.
        routes = torch.arange(topk).expand(b, seq_len, num_layers, topk).clone()
    pos_parts, id_parts = [], []
    lengths = torch.zeros(b, dtype=torch.long)
    for i, t in enumerate(trajs):
        if use_routes and t.routed_experts is None:
            raise ValueError(
                f"trajectory group={t.group_id} index={t.index} has no routed_experts but "
                "routing replay is on: generate with return_routed_experts (server flag "
                "--enable-return-routed-experts) or set replay=none"
            )
        # wrong layer count / top-k / expert ids / mask offsets: an error naming the trajectory
        t.validate(
            num_layers=num_layers if use_routes else None,
            topk=topk if use_routes else None,
            num_experts=num_experts if use_routes else None,
        )
        full = np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64)
        n, p, r = len(full) - 1, t.prompt_len, t.response_len
        if n > seq_len:
            raise ValueError(
                f"trajectory {t.group_id}/{t.index} has {n} input tokens > seq_len {seq_len}"
            )
        lengths[i] = n
        tokens[i, :n] = torch.from_numpy(full[:-1])
        labels[i, :n] = torch.from_numpy(full[1:])
        resp = slice(p - 1, p - 1 + r)  # positions whose label is a response token
        loss_mask[i, resp] = True
        rollout[i, resp] = torch.from_numpy(t.response_logprobs.astype(np.float32))
        sl = (
            t.sampling_logprobs
            if (use_mask and t.sampling_logprobs is not None)
            else t.response_logprobs
        )
        sampling[i, resp] = torch.from_numpy(np.asarray(sl, dtype=np.float32))
        versions[i, resp] = torch.from_numpy(t.versions.astype(np.int64))
        temperature[i, :] = float(t.temperature)
        if advantages is not None:
            adv[i, resp] = float(advantages[i])
        if use_routes:
            assert routes is not None
            routes[i, :n] = torch.from_numpy(np.asarray(t.routed_experts, dtype=np.int64))
        if use_mask and t.mask_ids is not None and t.mask_offsets is not None:
            counts = np.diff(t.mask_offsets).astype(np.int64)
            pos_parts.append(i * seq_len + (p - 1) + np.repeat(np.arange(r), counts))
            id_parts.append(np.asarray(t.mask_ids, dtype=np.int64))
    position_ids = torch.arange(seq_len).expand(b, seq_len).clone()
    mask_pos = torch.from_numpy(np.concatenate(pos_parts)) if pos_parts else None
    mask_ids = torch.from_numpy(np.concatenate(id_parts)) if id_parts else None
    return MicroBatch(
        tokens=tokens,
        labels=labels,
        position_ids=position_ids,
        loss_mask=loss_mask,
        rollout_logprobs=rollout,
        sampling_logprobs=sampling,
        versions=versions,
        temperature=temperature.reshape(-1),
        advantages=adv,
        routes=routes,
        mask_pos=mask_pos,
        mask_ids=mask_ids,
        seq_index=seq_index,
        lengths=lengths,
    )


def split_for_rank(num: int, dp_size: int, dp_rank: int, micro_batch_size: int) -> list[list[int]]:
    """Trajectory indices of this DP rank, grouped into micro-batches (equal counts per rank)."""
    if num % (dp_size * micro_batch_size):
        raise ValueError(
            f"{num} trajectories do not split evenly into data-parallel size {dp_size} × "
            f"micro_batch_size {micro_batch_size}; choose a global batch divisible by "
            f"{dp_size * micro_batch_size}"
        )
    per_rank = num // dp_size
    mine = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]


def step_microbatches(
    config: object,
    trajs: list[Trajectory],
    *,
    micro_batch_size: int,
    use_routes: bool,
    use_mask: bool,
    topk: int,
    num_layers: int,
    num_experts: int | None = None,
    advantages: list[float] | None = None,
) -> tuple[list[MicroBatch], int]:
    """This DP rank's micro-batches of a step and their padded length (a multiple of TP
    when sequence parallelism splits the sequence)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    seq_len = padded_length(trajs, tp if getattr(config, "sequence_parallel", False) else 1)
    groups = split_for_rank(
        len(trajs),
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_rank(),
        micro_batch_size,
    )
    mbs = [
        build_microbatch(
            [trajs[i] for i in g], g, seq_len, topk=topk, num_layers=num_layers,
            num_experts=num_experts, use_routes=use_routes, use_mask=use_mask,
            advantages=None if advantages is None else [advantages[i] for i in g],
        )
        for g in groups
    ]  # fmt: skip
    return mbs, seq_len
