"""moerl/common/module_walk.py: the kept walk is ``list(root.modules())`` after every kind
of change to the tree the module docstring names, and is reused while nothing changed."""

from __future__ import annotations

import gc
import weakref

from torch import nn

from moerl.common.module_walk import modules_of


def _tree() -> nn.Module:
    inner = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU(), nn.Linear(2, 2)]))
    return nn.Sequential(nn.Linear(2, 2), inner)


def _same(root: nn.Module) -> bool:
    got, want = modules_of(root), list(root.modules())
    return len(got) == len(want) and all(a is b for a, b in zip(got, want))


def test_an_unchanged_tree_reuses_its_walk() -> None:
    root = _tree()
    first = modules_of(root)
    assert _same(root)
    assert modules_of(root) is first
    nn.Linear(2, 2)  # building modules elsewhere registers parameters, not submodules
    assert modules_of(root) is first


def test_every_change_to_the_tree_is_walked_again() -> None:
    root = _tree()
    inner = root[1]
    layers = inner[1]
    assert _same(root)

    inner.extra = nn.Tanh()  # setattr of a new submodule, two levels down
    assert _same(root) and any(isinstance(m, nn.Tanh) for m in modules_of(root))

    old = layers[1]
    layers[1] = nn.GELU()  # replaced in place: the count of children is unchanged
    assert _same(root) and all(m is not old for m in modules_of(root))

    layers.insert(0, nn.Sigmoid())  # ModuleList.insert writes _modules directly
    assert _same(root) and any(isinstance(m, nn.Sigmoid) for m in modules_of(root))

    del inner.extra  # deletion fires no registration hook
    assert _same(root) and not any(isinstance(m, nn.Tanh) for m in modules_of(root))

    layers.append(nn.Linear(2, 2))
    assert _same(root)


def test_roots_keep_their_own_walks() -> None:
    a, b = _tree(), _tree()
    walk_a, walk_b = modules_of(a), modules_of(b)
    assert walk_a is not walk_b
    assert walk_a[0] is a and walk_b[0] is b
    a[1].extra = nn.Tanh()
    assert _same(a) and _same(b)
    assert len(modules_of(a)) == len(modules_of(b)) + 1


def test_training_flags_read_from_the_walk_follow_eval_and_train() -> None:
    root = _tree()
    root.eval()
    assert not any(m.training for m in modules_of(root))
    root.train()
    assert all(m.training for m in modules_of(root))
    root[1][1][1].eval()
    assert not all(m.training for m in modules_of(root))


def test_a_walked_model_is_freed_with_its_last_reference() -> None:
    root = _tree()
    modules_of(root)
    gone = weakref.ref(root)
    del root
    gc.collect()
    assert gone() is None
