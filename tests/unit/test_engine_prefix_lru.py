"""PrefixCache alone: longest match, LRU within the token budget, adapters, epochs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moerl.engine.core.prefix_cache import PrefixCache, Sequence, shared_prefix


def seq(tokens: list[int]) -> Sequence:
    """Keys/values/routes that name their token, so a slice shows where it came from."""
    t = torch.tensor(tokens, dtype=torch.float32)
    kv = [t[None, :, None].repeat(2, 1, 3)]
    routes = np.repeat(np.array(tokens, dtype=np.int32)[:, None, None], 2, axis=2)
    return Sequence(np.array(tokens, dtype=np.int64), kv, [x.clone() for x in kv], routes)


def test_shared_prefix():
    a = np.array([1, 2, 3, 4])
    assert shared_prefix(a, np.array([1, 2, 9])) == 2
    assert shared_prefix(a, np.array([1, 2])) == 2
    assert shared_prefix(a, np.array([7])) == 0


def test_longest_match_capped_at_limit():
    cache = PrefixCache(100)
    cache.insert(None, seq([1, 2, 3]), cache.epoch(None))
    cache.insert(None, seq([1, 2, 3, 4, 5, 6]), cache.epoch(None))  # replaces [1, 2, 3]
    cache.insert(None, seq([1, 9, 9, 9]), cache.epoch(None))
    assert len(cache) == 2 and cache.tokens == 10
    hit = cache.match(None, [1, 2, 3, 4, 7], limit=4)
    assert hit is not None and hit.length == 4
    assert hit.sequence.routes_TLK[:4, 0, 0].tolist() == [1, 2, 3, 4]
    assert cache.match(None, [1, 2, 3, 4, 7], limit=2).length == 2  # type: ignore[union-attr]
    assert cache.match(None, [5, 2], limit=1) is None
    assert cache.match(None, [1, 2], limit=0) is None
    # a sequence held already (a prefix of one cached) is not stored twice
    assert not cache.insert(None, seq([1, 2, 3, 4]), cache.epoch(None))
    assert cache.tokens == 10


def test_lru_eviction_keeps_the_budget():
    cache = PrefixCache(10)
    for first in (1, 2, 3):
        assert cache.insert(None, seq([first, 0, 0, 0]), cache.epoch(None))
    assert cache.tokens == 8 and len(cache) == 2
    assert cache.match(None, [1, 0, 0], 2) is None  # the oldest went
    assert cache.match(None, [2, 0, 0], 2) is not None  # now the most recent
    cache.insert(None, seq([4, 0, 0, 0]), cache.epoch(None))
    assert cache.match(None, [3, 0, 0], 2) is None  # [3...] was the least recently used
    assert cache.match(None, [2, 0, 0], 2) is not None
    assert not cache.insert(None, seq(list(range(11))), cache.epoch(None))  # over the budget
    assert cache.tokens <= 10


def test_adapters_and_epochs():
    cache = PrefixCache(100)
    old_a = cache.epoch("a")
    cache.insert("a", seq([1, 2, 3]), old_a)
    cache.insert(None, seq([1, 2, 3]), cache.epoch(None))
    assert cache.match("b", [1, 2, 3], 2) is None
    assert cache.match("a", [1, 2, 3], 2) is not None
    cache.flush_adapter("a")
    assert cache.match("a", [1, 2, 3], 2) is None and cache.match(None, [1, 2, 3], 2)
    assert not cache.insert("a", seq([1, 2]), old_a)  # admitted before "a" was replaced
    assert cache.insert(None, seq([5, 6]), cache.epoch(None))  # the base model is unchanged
    before = cache.epoch(None)
    cache.flush()
    assert cache.tokens == 0 and len(cache) == 0
    assert not cache.insert(None, seq([7]), before)  # ran across new weights


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="--prefix-cache-max-tokens 0"):
        PrefixCache(0)
