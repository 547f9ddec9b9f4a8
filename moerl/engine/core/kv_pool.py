"""The engine's KV cache: one tensor per layer holding every running request's keys and
values in its own slot, allocated once and read in place.

``keys[l]`` is [slots, H, capacity, Dk] (``values[l]`` [slots, H, capacity, Dv]); a request
owns one slot and its tokens 0..length-1 sit at positions 0..length-1 of it. A forward
writes its new keys/values into the slots (one indexed copy per layer) and attention reads
the slots it needs as a view: the running requests hold slots 0..B-1, so a decode step's
keys are ``keys[l][:B, :, :T]``, with no per-step copy. Freeing a slot moves the last used
slot into it (one copy of one request's KV), which keeps the used slots contiguous.

Both dimensions grow by doubling (the number of slots up to ``max_slots``, the capacity up
to ``max_tokens``), so a pool sized by its longest request is reallocated only a
logarithmic number of times. The layer shapes (H, D) are read from the first forward:
transformers' MLA caches its compressed latent, not per-head keys.

``SlotCache`` is the ``transformers.Cache`` a forward gets: it routes each layer's
``update`` to the pool. The forward also gets the 4D attention mask from ``attention_mask``
(query i of row b sees positions 0..start_b+i of its slot), which transformers passes to
the attention unchanged.
"""

# B rows, S new tokens per row (padded), T keys read, H kv heads, D head dim, L layers

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotOwner(Protocol):
    slot: int | None


@dataclass
class Plan:
    """Where one forward's rows read and write: row b is slot ``slots[b]``, its new tokens
    0..counts[b]-1 go to positions starts[b].. . Rows are left-padded to S, so every
    row's last token is column S-1 and one column of logits serves them all."""

    slots: list[int]
    starts: list[int]
    counts: list[int]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the index tensors, positions and mask are made: the model's device."""

    def __post_init__(self) -> None:
        self.width = max(self.counts)  # S
        self.keys_read = max(s + c for s, c in zip(self.starts, self.counts))  # T
        first = self.slots[0]
        self.contiguous = self.slots == list(range(first, first + len(self.slots)))
        rows: list[int] = []
        cols: list[int] = []
        slot_idx: list[int] = []
        pos_idx: list[int] = []
        for b, (slot, start, count) in enumerate(zip(self.slots, self.starts, self.counts)):
            rows += [b] * count
            cols += range(self.width - count, self.width)
            slot_idx += [slot] * count
            pos_idx += range(start, start + count)
        dev = self.device
        self.rows = torch.tensor(rows, device=dev)  # the valid (row, column) pairs of the input
        self.cols = torch.tensor(cols, device=dev)
        self.slot_idx = torch.tensor(slot_idx, device=dev)  # where each goes in the pool
        self.pos_idx = torch.tensor(pos_idx, device=dev)
        self.index = torch.tensor(self.slots, device=dev)

    def positions(self) -> torch.Tensor:
        """Position ids [B, S] (padding takes its row's first position)."""
        dev = self.device
        cols = torch.arange(self.width, device=dev)[None, :]
        first = self.width - torch.tensor(self.counts, device=dev)[:, None]  # first real column
        return torch.tensor(self.starts, device=dev)[:, None] + (cols - first).clamp(min=0)

    def attention_mask(self, dtype: torch.dtype, boolean: bool) -> torch.Tensor:
        """[B, 1, S, T]: the query at position p sees keys 0..p of its slot (padding: as
        its row's first token, whose key this forward writes). Boolean (True: attend)
        for SDPA, else additive for eager attention."""
        positions = self.positions()  # [B, S]
        keys = torch.arange(self.keys_read, device=self.device)
        allowed = keys[None, None, :] <= positions[:, :, None]  # [B, S, T]
        allowed = allowed[:, None]
        if boolean:
            return allowed
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class KVPool:
    """See the module docstring. Used by the scheduler thread only."""

    def __init__(
        self,
        num_layers: int,
        dtype: torch.dtype,
        max_slots: int,
        max_tokens: int,
        slots: int = 4,
        tokens: int = 64,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)  # the model's: every slot tensor lives there
        self.max_slots = max_slots
        self.max_tokens = max_tokens
        self.slots = min(slots, max_slots)
        self.capacity = min(tokens, max_tokens)
        self.keys: list[torch.Tensor] = []  # empty until the first forward's shapes
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []  # of used slots 0..used-1
        self.owners: list[SlotOwner] = []
        self.moves = 0  # frees that moved the last used slot's KV into the freed one
        self.reallocations = 0

    @property
    def used(self) -> int:
        return len(self.owners)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    # -- slots ---------------------------------------------------------------------------
    def alloc(self, owner: SlotOwner) -> int:
        """Give ``owner`` the next slot (empty) and set ``owner.slot``."""
        if self.used >= self.max_slots:
            raise RuntimeError(f"the KV pool has no free slot (max {self.max_slots})")
        self.reserve(self.used + 1, 0)
        owner.slot = self.used
        self.owners.append(owner)
        self.lengths.append(0)
        return owner.slot

    def free(self, owner: SlotOwner, wipe: bool = False) -> None:
        """Release ``owner``'s slot; the last used slot moves into it. ``wipe`` zeroes
        the slot first: attention reads every slot of a batch up to the longest row,
        masked positions included, and a masked value that is NaN (a request that failed
        on non-finite numbers) would still turn its weight-0 product into NaN."""
        slot = owner.slot
        if slot is None:
            return
        owner.slot = None
        if wipe:
            for tensor in self.keys + self.values:
                tensor[slot].zero_()
        last = self.used - 1
        if slot != last:
            self.moves += 1
            moved, length = self.owners[last], self.lengths[last]
            for pool in (self.keys, self.values):
                for tensor in pool:
                    tensor[slot, :, :length] = tensor[last, :, :length]
            self.owners[slot], self.lengths[slot] = moved, length
            moved.slot = slot
        self.owners.pop()
        self.lengths.pop()

    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        self.lengths[slot] = length

    def reserve(self, slots: int, tokens: int) -> None:
        """Room for ``slots`` slots of ``tokens`` positions (doubling what is short)."""
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens exceed the KV pool's {self.max_tokens} per request")
        new_slots, new_capacity = self.slots, self.capacity
        while new_slots < slots:
            new_slots = min(2 * new_slots, self.max_slots)
        while new_capacity < tokens:
            new_capacity = min(2 * new_capacity, self.max_tokens)
        if (new_slots, new_capacity) == (self.slots, self.capacity):
            return
        used, longest = self.used, max(self.lengths, default=0)
        for pool in (self.keys, self.values):
            for i, old in enumerate(pool):
                grown = old.new_zeros(new_slots, old.shape[1], new_capacity, old.shape[3])
                grown[:used, :, :longest] = old[:used, :, :longest]
                pool[i] = grown
        self.slots, self.capacity = new_slots, new_capacity
        self.reallocations += 1

    # -- one forward ---------------------------------------------------------------------
    def write(self, layer: int, plan: Plan, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the forward's new keys/values [B, H, S, D] of the rows' valid tokens."""
        if len(self.keys) <= layer:
            self._init_layer(layer, keys, values)
        if plan.width == 1:  # decode: one token per row
            self.keys[layer][plan.index, :, plan.pos_idx] = keys[:, :, 0]
            self.values[layer][plan.index, :, plan.pos_idx] = values[:, :, 0]
            return
        self.keys[layer][plan.slot_idx, :, plan.pos_idx] = keys[plan.rows, :, plan.cols]
        self.values[layer][plan.slot_idx, :, plan.pos_idx] = values[plan.rows, :, plan.cols]

    def read(self, layer: int, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [B, H, T, D] of the rows' slots: a view when the slots are
        contiguous (the running batch), else a gather."""
        t = plan.keys_read
        if plan.contiguous:
            first, last = plan.slots[0], plan.slots[-1] + 1
            return self.keys[layer][first:last, :, :t], self.values[layer][first:last, :, :t]
        keys = self.keys[layer].index_select(0, plan.index)[:, :, :t]
        return keys, self.values[layer].index_select(0, plan.index)[:, :, :t]

    def _init_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        while len(self.keys) <= layer:
            self.keys.append(torch.empty(0, device=self.device))
            self.values.append(torch.empty(0, device=self.device))
        shape = (self.slots, keys.shape[1], self.capacity)
        dev = self.device
        self.keys[layer] = torch.zeros(*shape, keys.shape[3], dtype=keys.dtype, device=dev)
        self.values[layer] = torch.zeros(*shape, values.shape[3], dtype=values.dtype, device=dev)

    # -- copies in and out (the prefix cache) ----------------------------------------------
    def load(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Put cached per-layer keys/values [H, n, D] at positions 0..n-1 of ``slot``."""
        n = keys[0].shape[1]
        self.reserve(self.used, n)
        if not self.keys:  # no forward yet: the shapes come from the cache
            for layer, (k, v) in enumerate(zip(keys, values)):
                self._init_layer(layer, k[None], v[None])
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.keys[layer][slot, :, :n] = k
            self.values[layer][slot, :, :n] = v
        self.lengths[slot] = n

    def copy_slot(self, source: int, target: int, n: int) -> None:
        """Positions 0..n-1 of ``source`` into ``target`` (samples sharing a prompt)."""
        for pool in (self.keys, self.values):
            for tensor in pool:
                tensor[target, :, :n] = tensor[source, :, :n]
        self.lengths[target] = n

    def copy_slots(self, sources: list[int], targets: list[int], n: int) -> None:
        """``copy_slot`` for many pairs at once: one indexed copy per pool tensor."""
        if not sources:
            return
        if len(sources) == 1:
            self.copy_slot(sources[0], targets[0], n)
            return
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        for pool in (self.keys, self.values):
            for tensor in pool:
                tensor[dst, :, :n] = tensor[src, :, :n]
        for target in targets:
            self.lengths[target] = n

    def export(self, slot: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of positions 0..n-1 of ``slot``: per-layer [H, n, D]."""
        return (
            [k[slot, :, :n].clone() for k in self.keys],
            [v[slot, :, :n].clone() for v in self.values],
        )


class _PoolLayer(CacheLayerMixin):
    """One layer of a ``SlotCache``: ``update`` writes into the pool and reads it back."""

    def __init__(self, pool: KVPool, layer: int, plan: Plan) -> None:
        super().__init__()
        self.pool, self.layer, self.plan = pool, layer, plan

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.pool.write(self.layer, self.plan, key_states, value_states)
        return self.pool.read(self.layer, self.plan)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.plan.keys_read, 0

    def get_seq_length(self) -> int:
        return min(self.plan.starts)

    def get_max_length(self) -> int:
        return self.pool.max_tokens


class SlotCache(Cache):
    """The ``transformers.Cache`` of one forward over pool slots (see the module docstring)."""

    def __init__(self, pool: KVPool, plan: Plan) -> None:
        super().__init__(layers=[_PoolLayer(pool, i, plan) for i in range(pool.num_layers)])
