"""The weight-sync group's default backend (moerl.config.sync.sync_backend) and whether
the trainer waits for each push to land (waits_for_load)."""

from __future__ import annotations

from configs_for_tests import compose_config

from moerl.config.sync import SyncConfig, sync_backend


def test_embedded_engines_sync_over_gloo_even_with_cuda():
    # an embedded engine shares the trainer's GPU by default: NCCL refuses two ranks there
    assert sync_backend(SyncConfig(), "embedded", has_cuda=True) == "gloo"
    assert sync_backend(SyncConfig(), "sglang", has_cuda=True) == "nccl"
    assert sync_backend(SyncConfig(), "sglang", has_cuda=False) == "gloo"
    assert sync_backend(SyncConfig(backend="nccl"), "embedded", has_cuda=True) == "nccl"


def test_wait_for_load_is_auto_true_or_false_and_auto_goes_on_only_past_async_broadcasts():
    """sync.wait_for_load: 'auto' by default, resolved by whether generation runs beside
    training and the push lands apart from its sending (a broadcast of full weights):
    the synchronous loop waits for every push to land, any other staleness goes on once
    a broadcast is off the wire, and a push that lands before it returns (tensor path,
    adapters) is waited for; true and false are kept as given; anything else is refused
    naming the choices. Checked on the recipe's own staleness groups, as the loop reads
    them."""
    import pytest
    from omegaconf import OmegaConf

    from moerl.config.sync import waits_for_load
    from moerl.config.threads import overlapped

    assert SyncConfig().wait_for_load == "auto"
    for value in (True, False, "auto"):
        SyncConfig(wait_for_load=value).validate()
    with pytest.raises(ValueError, match=r"sync.wait_for_load='yes': choose auto, true or false"):
        SyncConfig(wait_for_load="yes").validate()
    for staleness, waits in (("staleness=sync", True), ("staleness.max_staleness=1", False)):
        cfg = OmegaConf.to_object(compose_config("+recipe=deepseek_moe", staleness))
        over = overlapped(cfg.staleness)
        assert waits_for_load(cfg.sync, over, lands_apart=True) is waits, staleness
        assert waits_for_load(cfg.sync, over, lands_apart=False) is True, staleness
        for given in (True, False):
            assert waits_for_load(SyncConfig(wait_for_load=given), over, True) is given
