"""The weight-sync group's default backend (moerl.config.sync.sync_backend)."""

from __future__ import annotations

from moerl.config.sync import SyncConfig, sync_backend


def test_embedded_engines_sync_over_gloo_even_with_cuda():
    # an embedded engine shares the trainer's GPU by default: NCCL refuses two ranks there
    assert sync_backend(SyncConfig(), "embedded", has_cuda=True) == "gloo"
    assert sync_backend(SyncConfig(), "sglang", has_cuda=True) == "nccl"
    assert sync_backend(SyncConfig(), "sglang", has_cuda=False) == "gloo"
    assert sync_backend(SyncConfig(backend="nccl"), "embedded", has_cuda=True) == "nccl"


def test_wait_for_load_is_a_choice_of_true_or_false():
    """sync.wait_for_load: on by default (the trainer waits for every push to land);
    anything but a bool is refused naming the choices."""
    import pytest

    assert SyncConfig().wait_for_load is True
    SyncConfig(wait_for_load=False).validate()
    with pytest.raises(ValueError, match=r"sync.wait_for_load='yes': choose true or false"):
        SyncConfig(wait_for_load="yes").validate()  # type: ignore[arg-type]
