"""The rollout side the trainer's loop drives (``RolloutService``), on a real engine:
the hand-offs to its event loop around a weight push."""

from __future__ import annotations

from typing import Any

from configs_for_tests import compose_config
from omegaconf import OmegaConf

from moerl.rollout.service import RolloutService


def test_a_pushs_bracket_takes_the_rollout_metrics_in_its_own_hand_off(
    ds_engine, tiny_checkpoints, tmp_path
):
    """The synchronous loop asks for the rollout side's metrics just before each push:
    ``before_update(take_metrics=True)`` takes them in the hand-off it makes anyway, so
    the step's ``metrics()`` costs none; they hold the step's window, and the next call
    takes a new one. After the push, ``after_update`` returns once the next step's
    requests are out."""
    ckpt = tiny_checkpoints["deepseek_moe"]
    cfg: Any = OmegaConf.to_object(
        compose_config("+recipe=deepseek_moe", f"model.path={ckpt}", "staleness=sync",
                       "telemetry.timeline=false", "eval.every=0",
                       "rollout.max_new_tokens=256", "rollout.ignore_eos=true")
    )  # fmt: skip
    service = RolloutService(
        cfg, hf_dir=ckpt, run_dir=tmp_path, engine_urls=[ds_engine.url], engines=[],
        version=0, progress={}, groups_per_step=2,
    )  # fmt: skip
    try:
        client = service.client
        # the shared engine's version (other tests move it): the run's starts there
        old = int(service.aio.run(client.model_info())[ds_engine.url]["weight_version"])
        service.buffer.set_version(old)
        service.start()
        assert len(service.next_batch(old)) == 2 * cfg.rollout.group_size
        hand_offs = []
        run = service.aio.run

        def counted(coro: Any, timeout: float | None = None) -> Any:  # a spy: runs it
            hand_offs.append(coro)
            return run(coro, timeout)

        service.aio.run = counted  # type: ignore[method-assign]
        assert service.before_update(False, take_metrics=True) is False
        assert len(hand_offs) == 1
        step = service.metrics()
        assert len(hand_offs) == 1  # none of its own
        assert step["buffer/consumed"] == 2 and step["rollout/groups_done"] >= 2
        after = service.metrics()  # nothing taken since: a hand-off, a new window
        assert len(hand_offs) == 2 and after["buffer/consumed"] == 0
        # the synchronous loop: the hand-off after the push returns once the next step's
        # groups sent their requests (each runs for 256 tokens: still on the engine)
        run(client.update_weight_version(old + 1))  # what the push's last bucket does
        service.after_update(old + 1, paused=False)
        assert len(hand_offs) == 3
        assert sum(client.outstanding.values()) == 2
        # the last step's call waits for a running eval: it returns what the bracket
        # took (this run has no eval: no hand-off), not a newer window over it
        assert len(service.next_batch(old + 1)) == 2 * cfg.rollout.group_size
        assert service.before_update(False, take_metrics=True) is False
        taken = len(hand_offs)
        assert service.metrics(wait_eval=True)["buffer/consumed"] == 2
        assert len(hand_offs) == taken
    finally:
        service.close()
