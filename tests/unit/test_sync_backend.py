"""The weight-sync group's default backend (moerl.config.sync.sync_backend)."""

from __future__ import annotations

from moerl.config.sync import SyncConfig, sync_backend


def test_embedded_engines_sync_over_gloo_even_with_cuda():
    # an embedded engine shares the trainer's GPU by default: NCCL refuses two ranks there
    assert sync_backend(SyncConfig(), "embedded", has_cuda=True) == "gloo"
    assert sync_backend(SyncConfig(), "sglang", has_cuda=True) == "nccl"
    assert sync_backend(SyncConfig(), "sglang", has_cuda=False) == "gloo"
    assert sync_backend(SyncConfig(backend="nccl"), "embedded", has_cuda=True) == "nccl"


def test_the_trainer_waits_for_a_push_to_load_only_when_generation_waits_too():
    """sync.wait_for_load's auto (null): the trainer goes on beside a landing push when
    generation overlaps training, and waits for it with staleness=sync; a choice wins;
    anything else is refused naming the choices."""
    import pytest

    from moerl.config.buffer import StalenessConfig
    from moerl.config.sync import waits_for_load
    from moerl.config.threads import overlapped

    sync_run, async_run = StalenessConfig(max_staleness=0), StalenessConfig(max_staleness=1)
    assert waits_for_load(SyncConfig(), overlapped(sync_run))
    assert not waits_for_load(SyncConfig(), overlapped(async_run))
    assert not waits_for_load(SyncConfig(wait_for_load=False), overlapped(sync_run))
    assert waits_for_load(SyncConfig(wait_for_load=True), overlapped(async_run))
    with pytest.raises(ValueError, match=r"sync.wait_for_load='yes': choose true, false or null"):
        SyncConfig(wait_for_load="yes").validate()  # type: ignore[arg-type]
