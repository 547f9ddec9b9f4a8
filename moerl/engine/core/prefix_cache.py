"""The prefix cache: finished sequences' KV and routes, reused by requests that extend them.

The role of SGLang's radix cache (``--disable-radix-cache`` turns it off): a multi-turn
episode's next request is the previous turn's prompt + response + a few new tokens, so
its shared prefix need not be prefilled again. When a request ends, its processed tokens
(prompt + output but the last, sampled token) are kept with their keys/values per layer
and the experts each token was routed to, keyed by LoRA adapter (another adapter's KV is
another model's). A new request reuses the longest cached prefix of its input, and the
routes of those tokens are the cached ones: what the engine chose when it first ran them,
so Keep Routing replays one routing across turns.

A bounded LRU of whole sequences, found through a token trie: a sequence that extends a
cached one replaces it, and sequences sharing only a prompt (n > 1 samples) are kept
side by side. The trie (one node per distinct prefix, each knowing the sequences through
it) makes a lookup or an insert cost the length of its tokens, whatever the number of
sequences held. ``max_tokens`` bounds the tokens held; the least recently used sequences
go first. Every flush (new weights, ``/flush_cache``; an adapter loaded or unloaded
flushes that adapter's sequences) starts a new epoch, and a request admitted in an older
epoch is not cached when it ends: its KV mixes two sets of weights.
"""

# T tokens, H kv heads, D head dim, L layers, K top-k

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Sequence:
    """One cached sequence: its tokens, their KV per layer and their routes."""

    tokens_T: np.ndarray  # int64
    keys: list[torch.Tensor]  # per layer [H, T, Dk]
    values: list[torch.Tensor]  # per layer [H, T, Dv]
    routes_TLK: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.tokens_T)


@dataclass
class Match:
    """The first ``length`` tokens of ``sequence`` equal the request's first tokens."""

    sequence: Sequence
    length: int


def shared_prefix(a_T: np.ndarray, b_T: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a_T), len(b_T))
    differ = np.flatnonzero(a_T[:n] != b_T[:n])
    return int(differ[0]) if len(differ) else n


class _Node:
    """A trie node: one token prefix, the sequences through it and those ending at it."""

    __slots__ = ("children", "through", "ends")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.through: set[int] = set()  # keys of the sequences holding this prefix
        self.ends: set[int] = set()  # keys of the sequences that are exactly this prefix


class PrefixCache:
    """See the module docstring. Used by the scheduler thread only (no locking)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(
                f"--prefix-cache-max-tokens {max_tokens} must be >= 1 "
                "(turn the cache off with --disable-radix-cache)"
            )
        self.max_tokens = max_tokens
        self._epoch = 0  # moves on every flush
        self._adapter_epochs: dict[str, int] = {}  # moves when that adapter is replaced
        self.tokens = 0  # tokens held, over every sequence
        self._entries: OrderedDict[int, tuple[str | None, Sequence]] = OrderedDict()
        self._roots: dict[str | None, _Node] = {}  # one trie per adapter
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def epoch(self, adapter: str | None) -> tuple[int, int]:
        """What a request under ``adapter`` admitted now records, for ``insert``."""
        return self._epoch, self._adapter_epochs.get(adapter, 0) if adapter else 0

    def _walk(self, adapter: str | None, tokens: list[int], limit: int) -> list[_Node]:
        """The trie nodes of ``tokens``' prefixes of length 1..n held, n <= limit."""
        node, path = self._roots.get(adapter), list[_Node]()
        if node is None:
            return path
        for token in tokens[:limit]:
            node = node.children.get(token)
            if node is None:
                break
            path.append(node)
        return path

    def match(self, adapter: str | None, tokens: list[int], limit: int) -> Match | None:
        """The cached sequence under ``adapter`` sharing the longest prefix with
        ``tokens``, that prefix capped at ``limit``; None when nothing is shared."""
        if limit < 1:
            return None
        path = self._walk(adapter, [int(t) for t in tokens], limit)
        if not path:
            return None
        # every sequence through the deepest node shares exactly that prefix (capped);
        # the newest of them is taken
        key = max(path[-1].through)
        self._entries.move_to_end(key)  # used: the most recent
        return Match(self._entries[key][1], len(path))

    def insert(self, adapter: str | None, seq: Sequence, epoch: tuple[int, int]) -> bool:
        """Keep ``seq`` (a request admitted in ``epoch``), evicting the least recently
        used sequences to stay within ``max_tokens``. A sequence that is a prefix of
        ``seq`` is replaced; one that ``seq`` is a prefix of is kept instead. False when
        nothing was stored (an old epoch, empty, longer than the whole budget, or held
        already)."""
        if epoch != self.epoch(adapter) or not len(seq) or len(seq) > self.max_tokens:
            return False
        tokens = seq.tokens_T.tolist()
        path = self._walk(adapter, tokens, len(tokens))
        if len(path) == len(tokens):  # held already, whole
            self._entries.move_to_end(max(path[-1].through))
            return False
        for key in [k for node in path for k in node.ends]:  # seq extends them
            self._drop(key)
        while self.tokens + len(seq) > self.max_tokens:
            self._drop(next(iter(self._entries)))
        key = self._next_key
        self._next_key += 1
        self._entries[key] = (adapter, seq)
        node = self._roots.setdefault(adapter, _Node())
        for token in tokens:
            child = node.children.get(token)
            if child is None:  # (a setdefault would make a node for every token)
                child = node.children[token] = _Node()
            node = child
            node.through.add(key)
        node.ends.add(key)
        self.tokens += len(seq)
        return True

    def flush(self) -> None:
        """Drop every sequence and start a new epoch: requests running now are not cached
        when they end."""
        self._epoch += 1
        self._entries.clear()
        self._roots.clear()
        self.tokens = 0

    def flush_adapter(self, adapter: str) -> None:
        """As ``flush``, for the sequences and requests of one adapter only."""
        self._adapter_epochs[adapter] = self._adapter_epochs.get(adapter, 0) + 1
        for key, (name, _) in list(self._entries.items()):
            if name == adapter:
                self._drop(key)

    def _drop(self, key: int) -> None:
        adapter, seq = self._entries.pop(key)
        self.tokens -= len(seq)
        node = self._roots[adapter]
        for token in seq.tokens_T.tolist():
            child = node.children[token]
            child.through.discard(key)
            if not child.through:  # no sequence left below: prune the branch
                del node.children[token]
                break
            node = child
        else:
            node.ends.discard(key)
