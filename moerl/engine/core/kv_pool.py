"""The engine's KV cache: one tensor per layer holding every running request's keys and
values in its own slot, allocated once and read in place.

``keys[l]`` is [slots, H, capacity, Dk] (``values[l]`` [slots, H, capacity, Dv]); a request
owns one slot and its tokens 0..length-1 sit at positions 0..length-1 of it. A forward
writes its new keys/values into the slots (one indexed copy per layer) and attention reads
the slots it needs as a view: the running requests hold slots 0..B-1, so a decode step's
keys are ``keys[l][:B, :, :T]``, with no per-step copy. Freeing a slot moves the last used
slot into it (one copy of one request's KV), which keeps the used slots contiguous.

A slot may also read a **prefix** it does not hold: a prompt's keys/values kept elsewhere
(``Prefix``: a copy of the prompt, or a prefix-cache entry), shared by the n samples of a group,
so a group's memory grows with n × response, not n × (prompt + response), as SGLang's
shared pages give. Such a slot holds only the tokens after its prefix (its ``base``): a
token at position p sits at p - base. A forward whose rows have prefixes reads, per layer,
keys laid out as [the rows' prefixes (padded to the longest) | their own tokens] and a
mask over both, so every attention implementation runs unchanged.

Both dimensions grow to what is needed and by a quarter at least (``GROWTH``; the number
of slots up to ``max_slots``, the capacity up to ``max_tokens``), so a pool sized by its
longest request is reallocated a logarithmic number of times and holds at most a quarter
more than it needs (doubling held up to twice: a group's KV then missed the 1.3 x bound
of issue 29's target). The layer shapes (H, D) are read from the first forward:
transformers' MLA caches its compressed latent, not per-head keys (the
batch-invariant mode caches MLA's expanded keys and values: ``moerl.engine.core.invariant``).

In the batch-invariant mode a forward reads up to whole tiles of that attention's keys
(``Plan.read_whole_tiles``): the positions past the longest row are masked like those
past a shorter row, and the attention reads the keys and values in place instead of
copying them into zero-padded tiles (tools/bench/true_on_policy.py's batch: 3% of the
mode's time on the tiny model, 4% on the mid-sized one).

``SlotCache`` is the ``transformers.Cache`` a forward gets: it routes each layer's
``update`` to the pool. The forward also gets the 4D attention mask from ``attention_mask``
(query i of row b sees positions 0..start_b+i of its slot), which transformers passes to
the attention unchanged.
"""

# B rows, S new tokens per row (padded), T keys read, H kv heads, D head dim, L layers

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

GROWTH = 1.25
"""A pool dimension that is short grows to the need, and to this times its size at least."""


class SlotOwner(Protocol):
    slot: int | None


@dataclass(frozen=True, eq=False)
class Prefix:
    """The first ``length`` tokens' keys/values of a sequence, read by slots as their first
    tokens: per-layer tensors [H, >= length, D], kept, not copied (a prompt's copy that a
    group's samples share, or a prefix-cache entry's). Nothing writes them again."""

    held_keys: list[torch.Tensor]
    held_values: list[torch.Tensor]
    length: int

    def keys(self, layer: int) -> torch.Tensor:
        """[H, length, Dk], a view."""
        return self.held_keys[layer][:, : self.length]

    def values(self, layer: int) -> torch.Tensor:
        """[H, length, Dv], a view."""
        return self.held_values[layer][:, : self.length]

    def nbytes(self) -> int:
        """Bytes it keeps alive."""
        return sum(t.nbytes for t in self.held_keys + self.held_values)


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
    prefixes: list[Prefix | None] | None = None
    """Each row's prefix (None: the slot holds all its tokens); its tokens at positions
    start.. go to slot positions start - prefix length.."""

    def __post_init__(self) -> None:
        prefixes = self.prefixes or [None] * len(self.slots)
        self.bases = [0 if p is None else p.length for p in prefixes]
        self.width = max(self.counts)  # S
        # T: own positions read (and written up to)
        self.keys_read = max(s - b + c for s, b, c in zip(self.starts, self.bases, self.counts))
        self.prefix_width = max(self.bases)  # P: the prefixes' part of the keys read
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
            pos_idx += range(start - self.bases[b], start - self.bases[b] + count)
        dev = self.device
        self.rows = torch.tensor(rows, device=dev)  # the valid (row, column) pairs of the input
        self.cols = torch.tensor(cols, device=dev)
        self.slot_idx = torch.tensor(slot_idx, device=dev)  # where each goes in the pool
        self.pos_idx = torch.tensor(pos_idx, device=dev)
        self.index = torch.tensor(self.slots, device=dev)
        # the prefixes read, each with the batch rows reading it (the samples reading one
        # copy: one write per layer)
        self.prefix_reads: list[tuple[torch.Tensor, Prefix]] = []
        readers: dict[int, tuple[Prefix, list[int]]] = {}
        for b, prefix in enumerate(prefixes):
            if prefix is not None:
                readers.setdefault(id(prefix), (prefix, []))[1].append(b)
        for prefix, batch in readers.values():
            self.prefix_reads.append((torch.tensor(batch, device=dev), prefix))
        # the key columns before the own tokens that no prefix fills, zeroed: (batch rows,
        # first column); masked, but they must be finite (0 x NaN is NaN)
        self.prefix_gaps: list[tuple[torch.Tensor, int]] = []
        for rows_B, prefix in self.prefix_reads:
            if prefix.length < self.prefix_width:
                self.prefix_gaps.append((rows_B, prefix.length))
        bare = [b for b, p in enumerate(prefixes) if p is None]
        if bare and self.prefix_width:
            self.prefix_gaps.append((torch.tensor(bare, device=dev), 0))

    def read_whole_tiles(self, tile: int, most: int) -> None:
        """Read keys up to a whole number of ``tile`` keys (the prefixes' part included),
        at most ``most`` own positions: the batch-invariant attention takes keys in tiles
        (``kernels/batch_invariant.py``'s ``ATTENTION_KEYS``) and, so read, reads them in
        place instead of copying them into zero-padded tiles. The positions read past a
        row's own are masked, as those past a shorter row's are (finite: ``KVPool``
        zeroes what it allocates, and frees a failed request's slot wiped)."""
        whole = -(-(self.prefix_width + self.keys_read) // tile) * tile - self.prefix_width
        self.keys_read = max(self.keys_read, min(whole, most))

    def positions(self) -> torch.Tensor:
        """Position ids [B, S] (padding takes its row's first position)."""
        dev = self.device
        cols = torch.arange(self.width, device=dev)[None, :]
        first = self.width - torch.tensor(self.counts, device=dev)[:, None]  # first real column
        return torch.tensor(self.starts, device=dev)[:, None] + (cols - first).clamp(min=0)

    def attention_mask(self, dtype: torch.dtype, boolean: bool) -> torch.Tensor:
        """[B, 1, S, P + T]: the query at position p sees its prefix and keys 0..p - base
        of its slot (padding: as its row's first token, whose key this forward writes).
        Boolean (True: attend) for SDPA, else additive for eager attention."""
        positions = self.positions()  # [B, S]
        keys = torch.arange(self.keys_read, device=self.device)
        if self.prefix_width:
            bases = torch.tensor(self.bases, device=self.device)[:, None, None]
            allowed = keys[None, None, :] <= positions[:, :, None] - bases  # [B, S, T]
            prefix = torch.arange(self.prefix_width, device=self.device)
            seen = (prefix[None, None, :] < bases).expand(-1, self.width, -1)  # [B, S, P]
            allowed = torch.cat([seen, allowed], dim=2)
        else:
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
        tokens: int = 16,
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
        self.lengths: list[int] = []  # of used slots 0..used-1, prefix included
        self.prefixes: list[Prefix | None] = []  # of used slots
        self.owners: list[SlotOwner] = []
        self.moves = 0  # frees that moved the last used slot's KV into the freed one
        self.reallocations = 0
        self.attached = 0  # slots given a prefix to read
        self.peak_nbytes = 0  # the most ``nbytes`` seen after a growth or an attach

    @property
    def used(self) -> int:
        return len(self.owners)

    @property
    def tokens(self) -> int:
        """Tokens whose KV the used slots read, a shared prefix counted once."""
        shared: dict[int, int] = {}  # by the memory read: prefixes of one cache entry once
        for p in self.prefixes:
            if p is not None:
                shared[id(p.held_keys)] = max(p.length, shared.get(id(p.held_keys), 0))
        return sum(self.lengths) - sum(self.bases()) + sum(shared.values())

    @property
    def shared(self) -> int:
        """Used slots that read a prefix."""
        return sum(p is not None for p in self.prefixes)

    def bases(self) -> list[int]:
        return [0 if p is None else p.length for p in self.prefixes]

    def nbytes(self) -> int:
        """Bytes of KV this pool holds and reads: its own tensors and the prefixes its
        slots read (each counted once, whole)."""
        read = {id(p.held_keys): p for p in self.prefixes if p is not None}
        return sum(t.nbytes for t in self.keys + self.values) + sum(
            p.nbytes() for p in read.values()
        )

    # -- slots ---------------------------------------------------------------------------
    def alloc(self, owner: SlotOwner) -> int:
        """Give ``owner`` the next slot (empty) and set ``owner.slot``."""
        if self.used >= self.max_slots:
            raise RuntimeError(f"the KV pool has no free slot (max {self.max_slots})")
        self.reserve(self.used + 1, 0)
        owner.slot = self.used
        self.owners.append(owner)
        self.lengths.append(0)
        self.prefixes.append(None)
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
            moved, length, prefix = self.owners[last], self.lengths[last], self.prefixes[last]
            own = length - (0 if prefix is None else prefix.length)
            for pool in (self.keys, self.values):
                for tensor in pool:
                    tensor[slot, :, :own] = tensor[last, :, :own]
            self.owners[slot], self.lengths[slot], self.prefixes[slot] = moved, length, prefix
            moved.slot = slot
        self.owners.pop()
        self.lengths.pop()
        self.prefixes.pop()

    def length(self, slot: int) -> int:
        """Tokens of ``slot``'s sequence, its prefix included (its next position)."""
        return self.lengths[slot]

    def prefix(self, slot: int) -> Prefix | None:
        return self.prefixes[slot]

    def prefixes_of(self, slots: list[int]) -> list[Prefix | None] | None:
        """The slots' prefixes for a ``Plan`` (None when no used slot has one)."""
        if not any(p is not None for p in self.prefixes):
            return None
        return [self.prefixes[s] for s in slots]

    def attach(self, slot: int, prefix: Prefix) -> None:
        """``slot`` (empty) reads ``prefix`` as its first tokens; its own start after it."""
        if self.lengths[slot]:
            raise ValueError(
                f"slot {slot} holds {self.lengths[slot]} tokens: attach a prefix first"
            )
        self.prefixes[slot] = prefix
        self.lengths[slot] = prefix.length
        self.attached += 1
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes())

    def set_length(self, slot: int, length: int) -> None:
        self.lengths[slot] = length

    def reserve(self, slots: int, tokens: int) -> None:
        """Room for ``slots`` slots of ``tokens`` positions (what is short grows to the
        need, and by ``GROWTH`` at least)."""
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens exceed the KV pool's {self.max_tokens} per request")
        if self.keys and slots <= self.slots and tokens <= self.capacity:
            return  # the common case: room already
        new_slots, new_capacity = self.slots, self.capacity
        if new_slots < slots:
            new_slots = min(max(slots, math.ceil(GROWTH * new_slots)), self.max_slots)
        if new_capacity < tokens:
            new_capacity = min(max(tokens, math.ceil(GROWTH * new_capacity)), self.max_tokens)
        if (new_slots, new_capacity) == (self.slots, self.capacity):
            return
        used = self.used
        longest = max((n - b for n, b in zip(self.lengths, self.bases())), default=0)
        for pool in (self.keys, self.values):
            for i, old in enumerate(pool):
                # the used slots' tokens copied, every other position zeroed (as allocated)
                grown = old.new_empty(new_slots, old.shape[1], new_capacity, old.shape[3])
                grown[:used, :, :longest] = old[:used, :, :longest]
                grown[:used, :, longest:] = 0
                grown[used:] = 0
                pool[i] = grown
        self.slots, self.capacity = new_slots, new_capacity
        self.reallocations += 1
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes())

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
        contiguous (the running batch), else a gather. Rows with prefixes: [B, H, P + T,
        D], the prefixes (padded to the longest, P) before the slots' own tokens."""
        t = plan.keys_read
        if plan.contiguous:
            first, last = plan.slots[0], plan.slots[-1] + 1
            keys, values = (
                self.keys[layer][first:last, :, :t],
                self.values[layer][first:last, :, :t],
            )
        else:
            keys = self.keys[layer].index_select(0, plan.index)[:, :, :t]
            values = self.values[layer].index_select(0, plan.index)[:, :, :t]
        if not plan.prefix_width:
            return keys, values
        out = []
        for own, which in ((keys, "keys"), (values, "values")):
            b, h, _, d = own.shape
            both = own.new_empty(b, h, plan.prefix_width + t, d)
            both[:, :, plan.prefix_width :] = own
            for batch, prefix in plan.prefix_reads:
                kept = prefix.keys(layer) if which == "keys" else prefix.values(layer)
                both[batch, :, : prefix.length] = kept  # [H, P, D], to every row reading it
            for batch, first in plan.prefix_gaps:
                both[batch, :, first : plan.prefix_width] = 0
            out.append(both)
        return out[0], out[1]

    def _init_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        while len(self.keys) <= layer:
            self.keys.append(torch.empty(0, device=self.device))
            self.values.append(torch.empty(0, device=self.device))
        shape = (self.slots, keys.shape[1], self.capacity)
        dev = self.device
        self.keys[layer] = torch.zeros(*shape, keys.shape[3], dtype=keys.dtype, device=dev)
        self.values[layer] = torch.zeros(*shape, values.shape[3], dtype=values.dtype, device=dev)
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes())

    def token_nbytes(self) -> int:
        """Bytes of one token's keys and values over every layer (0 before a forward)."""
        return sum(t.shape[1] * t.shape[3] * t.element_size() for t in self.keys + self.values)

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
        self.lengths[slot], self.prefixes[slot] = n, None

    def load_from(self, source: KVPool, pairs: list[tuple[int, int, int]]) -> None:
        """Give this pool's slot d the first n tokens of ``source``'s slot s, for every
        (s, d, n): s's own tokens copied, in one indexed copy per pool tensor, after the
        prefix s reads, which d then reads too (the target slots are empty: the prompts a
        prefill ran elsewhere, going to the requests' own slots)."""
        if not pairs:
            return
        bases = source.bases()
        longest = max(n - bases[s] for s, _, n in pairs)
        self.reserve(self.used, longest)
        if not self.keys:
            for layer in range(len(source.keys)):
                self._init_layer(layer, source.keys[layer][:1], source.values[layer][:1])
        src = torch.tensor([s for s, _, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d, _ in pairs], device=self.device)
        for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
            for target, held in zip(mine, theirs):
                # positions past a row's n: the source's (finite) values, never read
                target[dst, :, :longest] = held[:, :, :longest].index_select(0, src)
        for s, d, n in pairs:
            self.lengths[d], self.prefixes[d] = n, source.prefixes[s]
            if source.prefixes[s] is not None:
                self.attached += 1
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes())

    def export_many(
        self, wanted: list[tuple[int, int]]
    ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """``export`` of each (slot, n), equal to it, in fewer ops: the slots that read no
        prefix are gathered in one indexed copy per pool tensor and split into per-layer
        [H, n, D] views of it (a decode step's finished requests share one allocation per
        layer, freed once none of them is kept); the others are exported one by one."""
        out: list[Any] = [None] * len(wanted)
        alone = [i for i, (slot, n) in enumerate(wanted) if self.prefixes[slot] is None and n]
        if len(alone) > 1:
            counts = [wanted[i][1] for i in alone]
            n_S = np.asarray(counts)
            starts_S = np.cumsum(n_S) - n_S
            # each token's (slot, position): slot s's positions 0..n_s-1, slot after slot
            rows = torch.from_numpy(np.repeat([wanted[i][0] for i in alone], n_S))
            at = torch.from_numpy(np.arange(n_S.sum()) - np.repeat(starts_S, n_S))
            rows, at = rows.to(self.device), at.to(self.device)

            def parts(pool: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
                # [H, sum(n), D]: the slots' tokens back to back, then one view each
                return [t.transpose(0, 1)[:, rows, at].split(counts, dim=1) for t in pool]

            keys, values = parts(self.keys), parts(self.values)
            for j, i in enumerate(alone):
                out[i] = ([k[j] for k in keys], [v[j] for v in values])
        for i, (slot, n) in enumerate(wanted):
            if out[i] is None:
                out[i] = self.export(slot, n)
        return out

    def export(self, slot: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of positions 0..n-1 of ``slot`` (its prefix's first): per-layer [H, n, D]."""
        prefix = self.prefixes[slot]
        if prefix is None:
            return (
                [k[slot, :, :n].clone() for k in self.keys],
                [v[slot, :, :n].clone() for v in self.values],
            )
        p = min(n, prefix.length)
        own = n - p
        keys, values = [], []
        for layer in range(len(self.keys)):
            keys.append(torch.cat([prefix.keys(layer)[:, :p], self.keys[layer][slot, :, :own]], 1))
            values.append(
                torch.cat([prefix.values(layer)[:, :p], self.values[layer][slot, :, :own]], 1)
            )
        return keys, values


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
        return self.plan.prefix_width + self.plan.keys_read, 0

    def get_seq_length(self) -> int:
        return min(self.plan.starts)

    def get_max_length(self) -> int:
        return self.pool.max_tokens


class SlotCache(Cache):
    """The ``transformers.Cache`` of one forward over pool slots (see the module docstring)."""

    def __init__(self, pool: KVPool, plan: Plan) -> None:
        super().__init__(layers=[_PoolLayer(pool, i, plan) for i in range(pool.num_layers)])
