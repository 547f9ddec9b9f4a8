"""The weight-sync group's default backend (moerl.config.sync.sync_backend)."""

from __future__ import annotations

from moerl.config.sync import SyncConfig, sync_backend


def test_embedded_engines_sync_over_gloo_even_with_cuda():
    # an embedded engine shares the trainer's GPU by default: NCCL refuses two ranks there
    assert sync_backend(SyncConfig(), "embedded", has_cuda=True) == "gloo"
    assert sync_backend(SyncConfig(), "sglang", has_cuda=True) == "nccl"
    assert sync_backend(SyncConfig(), "sglang", has_cuda=False) == "gloo"
    assert sync_backend(SyncConfig(backend="nccl"), "embedded", has_cuda=True) == "nccl"
