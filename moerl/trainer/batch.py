"""Trajectories → padded micro-batches for this data-parallel rank.

Each trajectory trains on its P+R−1 input tokens (prompt + response without the last
token), predicting tokens 1..P+R−1; the engine's routed-experts rows are exactly one
per input token (SGLang's convention), so routes need no padding. Sequences are padded
to one length per step (a multiple of TP, for sequence parallelism) so pipeline stages
exchange fixed shapes. Tokens are flattened batch-major: index = b · S + s.
"""

# B sequences per micro-batch, S padded length, L layers, K top-k, N kept (pos, id) pairs

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moerl.common.checks import one_of
from moerl.common.trajectory import Trajectory
from moerl.device import all_reduce_host, device


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # int64 [B, S]
    labels: torch.Tensor  # int64 [B, S]
    position_ids: torch.Tensor  # int64 [B, S] position within its own sequence
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
    lengths: torch.Tensor  # int64 [B] real tokens per row (the rest is padding)
    seq_ids: torch.Tensor  # int64 [B, S] position of the token's trajectory in seq_index; -1 = pad
    response_mask: torch.Tensor | None = None  # bool [B, S]: the label is a response token
    # (trained or not: an episode's observations are response tokens outside loss_mask)
    attention_mask: torch.Tensor | None = None  # bool [B, 1, S, S], True = masked (packed rows)
    ref_logprobs: torch.Tensor | None = None  # fp32 [B, S] reference policy (KL term)
    old_logprobs: torch.Tensor | None = None  # fp32 [B, S] π_old, the trainer before the update
    is_weights: torch.Tensor | None = None  # fp32 [B, S] the correction's weights (0 = dropped)

    def to(self, target: torch.device) -> MicroBatch:
        """This micro-batch with every tensor on ``target`` (the model's device); built on
        the CPU, it moves once, before its forward."""
        moved = {
            f.name: getattr(self, f.name).to(target, non_blocking=True)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def valid(self) -> torch.Tensor:
        """bool [B, S]: real (non-padding) input tokens."""
        return self.seq_ids >= 0

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def padding_mask(self, model: Any) -> torch.Tensor:
        """bool [B, S] (True = padding) for ``model``'s MoE routers, so padding tokens stay
        out of expert-bias load counts and auxiliary losses. megatron-core splits it for
        sequence parallelism only on the first pipeline stage; later stages get it split."""
        pad_BS = ~self.valid()
        module = getattr(model, "module", model)
        if module.pre_process or not module.config.sequence_parallel:
            return pad_BS
        from megatron.core import parallel_state

        size = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        per = pad_BS.shape[1] // size
        return pad_BS[:, rank * per : (rank + 1) * per].contiguous()


PACKING = ("padded", "packed")

Advantage = float | np.ndarray
"""A trajectory's advantage: one number, or one per response token (float32 [R])."""


def token_advantages(advantage: Advantage, t: Trajectory) -> np.ndarray:
    """float32 [R]: ``advantage`` on every response token of ``t``."""
    values = np.asarray(advantage, dtype=np.float32)
    if values.ndim == 0:
        return np.full(t.response_len, float(values), dtype=np.float32)
    if values.shape != (t.response_len,):
        raise ValueError(
            f"the advantages of {t.name()} have shape {values.shape}; expected a number or "
            f"({t.response_len},), one per response token"
        )
    return values


def behaviour_logprobs(t: Trajectory, use_mask: bool) -> np.ndarray:
    """μ of each response token: over the sampling mask's kept set when one was recorded
    and the mask is replayed, else over the full vocabulary: [R]."""
    if use_mask and t.sampling_logprobs is not None:
        return np.asarray(t.sampling_logprobs, dtype=np.float32)
    return np.asarray(t.response_logprobs, dtype=np.float32)


def input_len(t: Trajectory) -> int:
    return t.prompt_len + t.response_len - 1


def padded_length(trajs: list[Trajectory], multiple: int, at_least: int = 0) -> int:
    longest = max(max(input_len(t) for t in trajs), at_least)
    return -(-longest // multiple) * multiple


def pack_rows(lengths: list[int], row_len: int) -> list[list[int]]:
    """First-fit packing of sequences (in order) into rows of ``row_len`` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        if n > row_len:
            raise ValueError(f"a sequence of {n} tokens does not fit trainer.pack_length={row_len}")
        slot = next((r for r, f in enumerate(free) if f >= n), None)
        if slot is None:
            rows.append([])
            free.append(row_len)
            slot = len(rows) - 1
        rows[slot].append(i)
        free[slot] -= n
    return rows


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
    advantages: list[Advantage] | None = None,
    ref_logprobs: list[np.ndarray] | None = None,
    old_logprobs: list[np.ndarray] | None = None,
    is_weights: list[np.ndarray] | None = None,
    rows: list[list[int]] | None = None,
) -> MicroBatch:
    """``rows[b]`` lists the trajectories (positions in ``trajs``) packed one after the
    other into row b; by default one per row (padded). Packed rows get a block-diagonal
    causal attention mask, so each sequence sees only itself; RoPE is relative, so a
    sequence's offset in its row does not change its attention. An episode's spliced
    tokens (``Trajectory.loss_mask`` 0) are inputs but never in the loss; an advantage
    is one number per trajectory or one per response token ([R], per-turn credit)."""
    packed = rows is not None
    if rows is None:
        rows = [[i] for i in range(len(trajs))]
    b = len(rows)
    # filled as numpy arrays (a slice assignment there costs a fraction of a torch one,
    # and this loop makes about twenty per trajectory), made tensors once at the end
    tokens = np.zeros((b, seq_len), dtype=np.int64)
    labels = np.zeros((b, seq_len), dtype=np.int64)
    position_ids = np.zeros((b, seq_len), dtype=np.int64)
    seq_ids = np.full((b, seq_len), -1, dtype=np.int64)
    loss_mask = np.zeros((b, seq_len), dtype=bool)
    response_mask = np.zeros((b, seq_len), dtype=bool)
    rollout = np.zeros((b, seq_len), dtype=np.float32)
    sampling = np.zeros((b, seq_len), dtype=np.float32)
    versions = np.zeros((b, seq_len), dtype=np.int64)
    temperature = np.ones((b, seq_len), dtype=np.float32)
    adv = np.zeros((b, seq_len), dtype=np.float32)
    # per response token, given per trajectory: reference, old policy, correction weights
    given = {"ref_logprobs": ref_logprobs, "old_logprobs": old_logprobs, "is_weights": is_weights}
    per_token = {
        k: np.zeros((b, seq_len), dtype=np.float32) for k, v in given.items() if v is not None
    }
    routes = None
    if use_routes:
        # Padding positions route to experts 0..K-1 (valid, distinct); they carry no loss.
        routes = np.broadcast_to(np.arange(topk), (b, seq_len, num_layers, topk)).copy()
    pos_parts, id_parts = [], []
    lengths = [0] * b
    for row, members in enumerate(rows):
        for i in members:
            t = trajs[i]
            if use_routes and t.routed_experts is None:
                raise ValueError(
                    f"trajectory group={t.group_id} index={t.index} has no routed_experts but "
                    "routing replay is on: generate with return_routed_experts (server flag "
                    "--enable-return-routed-experts) or set replay=none"
                )
            # wrong layer count / top-k / expert ids / mask offsets: an error naming it
            t.validate(
                num_layers=num_layers if use_routes else None,
                topk=topk if use_routes else None,
                num_experts=num_experts if use_routes else None,
            )
            full = np.concatenate([t.prompt_ids, t.response_ids]).astype(np.int64)
            n, p, r = len(full) - 1, t.prompt_len, t.response_len
            o = lengths[row]  # this sequence's offset in its row
            if o + n > seq_len:
                raise ValueError(
                    f"trajectory {t.group_id}/{t.index} has {n} input tokens > {seq_len - o} "
                    f"free in a row of seq_len {seq_len}"
                )
            lengths[row] = o + n
            span = slice(o, o + n)
            tokens[row, span] = full[:-1]
            labels[row, span] = full[1:]
            position_ids[row, span] = np.arange(n)
            seq_ids[row, span] = i
            resp = slice(o + p - 1, o + p - 1 + r)  # positions whose label is a response token
            loss_mask[row, resp] = t.trained
            response_mask[row, resp] = True
            rollout[row, resp] = t.response_logprobs
            sampling[row, resp] = behaviour_logprobs(t, use_mask)
            versions[row, resp] = t.versions
            if r:  # prompt rows were routed by the forward that sampled token 0 (route_versions)
                versions[row, o : o + p - 1] = int(t.versions[0])
            temperature[row, span] = float(t.temperature)
            if advantages is not None:
                adv[row, resp] = token_advantages(advantages[i], t)
            for key, values in per_token.items():
                given_i = np.asarray(given[key][i], dtype=np.float32)  # type: ignore[index]
                if given_i.shape != (r,):
                    raise ValueError(
                        f"{key} of trajectory {t.group_id}/{t.index} has shape "
                        f"{given_i.shape}; expected ({r},), one per response token"
                    )
                values[row, resp] = given_i
            if use_routes:
                assert routes is not None
                routes[row, span] = np.asarray(t.routed_experts, dtype=np.int64)
            if use_mask and t.mask_ids is not None and t.mask_offsets is not None:
                counts = np.diff(t.mask_offsets).astype(np.int64)
                pos_parts.append(row * seq_len + o + (p - 1) + np.repeat(np.arange(r), counts))
                id_parts.append(np.asarray(t.mask_ids, dtype=np.int64))
    if not packed:
        position_ids = np.broadcast_to(np.arange(seq_len), (b, seq_len)).copy()
    seq_ids_t = torch.from_numpy(seq_ids)
    attention_mask = None
    if packed:
        # True = masked (megatron's convention): other sequences and the future. Padding
        # (seq id -1) sees only padding: a fully masked row would give NaN in SDPA.
        same = seq_ids_t[:, :, None] == seq_ids_t[:, None, :]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        attention_mask = ~(same & causal)[:, None]
    mask_pos = torch.from_numpy(np.concatenate(pos_parts)) if pos_parts else None
    mask_ids = torch.from_numpy(np.concatenate(id_parts)) if id_parts else None
    as_t = torch.from_numpy
    return MicroBatch(
        tokens=as_t(tokens),
        labels=as_t(labels),
        position_ids=as_t(position_ids),
        loss_mask=as_t(loss_mask),
        rollout_logprobs=as_t(rollout),
        sampling_logprobs=as_t(sampling),
        versions=as_t(versions),
        temperature=as_t(temperature.reshape(-1)),
        advantages=as_t(adv),
        routes=None if routes is None else as_t(routes),
        mask_pos=mask_pos,
        mask_ids=mask_ids,
        seq_index=seq_index,
        lengths=torch.tensor(lengths, dtype=torch.long),
        seq_ids=seq_ids_t,
        response_mask=as_t(response_mask),
        attention_mask=attention_mask,
        **{k: as_t(v) for k, v in per_token.items()},
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


def token_groups(lengths: list[int], max_tokens: int, multiple: int = 1) -> list[list[int]]:
    """Positions of ``lengths`` (sequence lengths in tokens) grouped into micro-batches
    whose padded size, rows × the group's longest sequence (rounded up to ``multiple``),
    stays within ``max_tokens``: longest first, so sequences of like length share a
    micro-batch and little is padding. A sequence longer than the budget goes alone.
    Positions within a group keep their order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    longest = 0
    for i in order:
        n = -(-lengths[i] // multiple) * multiple
        if groups and max(longest, n) * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return [sorted(g) for g in groups]


def split_groups(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` split (the largest first, in halves) until there are ``count`` of them,
    so every data-parallel rank runs the same number of micro-batches."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda j: len(groups[j]))
        if len(groups[k]) < 2:
            raise ValueError(f"cannot split {len(groups)} micro-batches into {count}")
        g = groups.pop(k)
        half = (len(g) + 1) // 2
        groups[k:k] = [g[:half], g[half:]]
    return groups


def rows_within(budget_rows: int, per_rank: int) -> int:
    """The largest divisor of ``per_rank`` that is at most ``budget_rows`` (at least 1):
    rows per micro-batch when the pipeline needs one micro-batch shape for the step."""
    return max(d for d in range(1, max(1, min(budget_rows, per_rank)) + 1) if per_rank % d == 0)


def _max_over_dp(n: int) -> int:
    """The largest ``n`` over the data-parallel ranks (collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() == 1:
        return n
    group = parallel_state.get_data_parallel_group()
    return int(all_reduce_host(torch.tensor([n]), dist.ReduceOp.MAX, group))


def _packed_groups(
    trajs: list[Trajectory], row_len: int, micro_batch_size: int
) -> list[tuple[list[int], list[list[int]]]]:
    """This DP rank's share of ``trajs`` packed into rows; every DP rank gets the same
    number of micro-batches of ``micro_batch_size`` rows (short ranks add empty rows), as
    the pipeline schedule and expert-parallel collectives need."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    if len(trajs) % dp:
        raise ValueError(
            f"{len(trajs)} trajectories do not split evenly over data-parallel size {dp}; "
            f"choose a global batch divisible by {dp}"
        )
    per_rank = len(trajs) // dp
    start = parallel_state.get_data_parallel_rank() * per_rank
    mine = list(range(start, start + per_rank))
    rows = pack_rows([input_len(trajs[i]) for i in mine], row_len)
    total = -(-_max_over_dp(len(rows)) // micro_batch_size) * micro_batch_size
    rows += [[] for _ in range(total - len(rows))]
    groups = []
    for first in range(0, total, micro_batch_size):
        chunk = rows[first : first + micro_batch_size]
        members = [mine[j] for row in chunk for j in row]
        local, k = [], 0
        for row in chunk:
            local.append(list(range(k, k + len(row))))
            k += len(row)
        groups.append((members, local))
    return groups


def _by_tokens(
    trajs: list[Trajectory], max_tokens: int, multiple: int, seq_len: int
) -> list[tuple[list[int], int]]:
    """This DP rank's trajectories in micro-batches of at most ``max_tokens`` padded
    tokens, each with its row length. Without pipeline parallelism each micro-batch is
    padded to its own longest sequence (like lengths grouped together); with it the
    schedule needs one shape, so rows are ``seq_len`` long and every micro-batch has the
    same number of them. Every DP rank gets the same number of micro-batches (expert
    parallelism's collectives pair them up)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    mine = [i for g in split_for_rank(len(trajs), dp, parallel_state.get_data_parallel_rank(), 1)
            for i in g]  # fmt: skip
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        rows = rows_within(max_tokens // seq_len, len(mine))
        return [(mine[k : k + rows], seq_len) for k in range(0, len(mine), rows)]
    lengths = [input_len(trajs[i]) for i in mine]
    groups = token_groups(lengths, max_tokens, multiple)
    groups = split_groups(groups, _max_over_dp(len(groups)))
    out = []
    for g in groups:
        longest = max(lengths[j] for j in g)
        out.append(([mine[j] for j in g], -(-longest // multiple) * multiple))
    return out


def step_microbatches(
    config: object,
    trajs: list[Trajectory],
    *,
    micro_batch_size: int,
    use_routes: bool | None,
    use_mask: bool,
    topk: int,
    num_layers: int,
    num_experts: int | None = None,
    advantages: list[Advantage] | None = None,
    ref_logprobs: list[np.ndarray] | None = None,
    old_logprobs: list[np.ndarray] | None = None,
    is_weights: list[np.ndarray] | None = None,
    packing: str = "padded",
    pack_length: int = 0,
    max_tokens: int = 0,
) -> tuple[list[MicroBatch], int]:
    """This DP rank's micro-batches of a step and their longest row length (a multiple of
    TP when sequence parallelism splits the sequence). ``padded``: one sequence per row.
    ``packed``: sequences first-fit into rows of ``pack_length`` tokens (at least the
    longest sequence); ``micro_batch_size`` then counts rows. ``max_tokens`` > 0 sizes
    micro-batches by padded tokens instead of ``micro_batch_size`` (verl's
    ``ppo_max_token_len_per_gpu``, slime's ``--max-tokens-per-gpu``; see ``_by_tokens``;
    packed: as many rows as fit). ``ref_logprobs``, ``old_logprobs`` and ``is_weights``
    hold one [R] array per trajectory. ``use_routes`` None: the routes when every
    trajectory this rank builds has them (other ranks' may arrive without:
    ``moerl.trainer.shard``)."""
    from megatron.core import parallel_state

    one_of("trainer.packing", packing, PACKING)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    multiple = tp if getattr(config, "sequence_parallel", False) else 1
    seq_len = padded_length(trajs, multiple, at_least=pack_length if packing == "packed" else 0)
    # (trajectories, packed rows or None, row length)
    groups: Sequence[tuple[list[int], list[list[int]] | None, int]]
    if packing == "packed":
        rows = max(1, max_tokens // seq_len) if max_tokens > 0 else micro_batch_size
        groups = [(g, r, seq_len) for g, r in _packed_groups(trajs, seq_len, rows)]
    elif max_tokens > 0:
        groups = [(g, None, n) for g, n in _by_tokens(trajs, max_tokens, multiple, seq_len)]
    else:
        groups = [
            (g, None, seq_len)
            for g in split_for_rank(
                len(trajs),
                parallel_state.get_data_parallel_world_size(),
                parallel_state.get_data_parallel_rank(),
                micro_batch_size,
            )
        ]
    if use_routes is None:
        use_routes = all(trajs[i].routed_experts is not None for g, _, _ in groups for i in g)
    mbs = [
        build_microbatch(
            [trajs[i] for i in g], g, length, topk=topk, num_layers=num_layers,
            num_experts=num_experts, use_routes=use_routes, use_mask=use_mask,
            advantages=None if advantages is None else [advantages[i] for i in g],
            ref_logprobs=None if ref_logprobs is None else [ref_logprobs[i] for i in g],
            old_logprobs=None if old_logprobs is None else [old_logprobs[i] for i in g],
            is_weights=None if is_weights is None else [is_weights[i] for i in g],
            rows=rows,
        )
        for g, rows, length in groups
    ]  # fmt: skip
    target = device()
    if target.type != "cpu":
        mbs = [mb.to(target) for mb in mbs]
    return mbs, seq_len


def schedule_shape(mbs: list[MicroBatch]) -> tuple[int, int]:
    """(rows, row length) the pipeline schedule is told: the micro-batches' largest (with
    pipeline parallelism they are all one shape; without it the schedule ignores both)."""
    if not mbs:
        return 1, 1
    return max(mb.tokens.shape[0] for mb in mbs), max(mb.tokens.shape[1] for mb in mbs)
