"""RolloutBuffer: sampling order, staleness drops, backpressure, synchronous mode, metrics,
checkpoints, shutdown, config errors; the buffer/staleness YAML options compose in Hydra."""

from __future__ import annotations

import asyncio
import itertools
import json

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from moerl.common.trajectory import Trajectory
from moerl.config.buffer import (
    SAMPLING_OPTIONS,
    BufferConfig,
    CorrectStaleConfig,
    CustomStalenessConfig,
    DepthConfig,
    DropStaleConfig,
    FreshestConfig,
    StalenessConfig,
    register_buffer_configs,
)
from moerl.rollout.buffer import BufferClosed, RolloutBuffer
from moerl.rollout.buffer_policies import (
    SamplingInput,
    StalenessInput,
    StalenessOutput,
    build_sampling,
)

# --- helpers --------------------------------------------------------------------------


def make_group(gid: str, versions: list[int], size: int = 2, reward: float | None = 1.0) -> list:
    """`size` completions of prompt `gid`; every completion's tokens have `versions`."""
    versions_R = np.asarray(versions, dtype=np.int32)
    R = versions_R.shape[0]
    return [
        Trajectory(
            prompt_ids=np.array([1, 2], dtype=np.int32),
            response_ids=np.arange(3, 3 + R, dtype=np.int32),
            response_logprobs=np.full(R, -0.5, dtype=np.float32),
            versions=versions_R,
            reward=None if reward is None else reward + i,
            group_id=gid,
            index=i,
        )
        for i in range(size)
    ]


def gids(groups: list) -> list[str]:
    return [g[0].group_id for g in groups]


def buffer(max_groups: int = 8, staleness: StalenessConfig | None = None, **kw) -> RolloutBuffer:
    staleness = staleness or DropStaleConfig(max_staleness=100)
    return RolloutBuffer(BufferConfig(max_groups=max_groups), staleness, **kw)


async def settle() -> None:
    """Let every runnable task run until it blocks."""
    for _ in range(10):
        await asyncio.sleep(0)


def keep_odd_groups(inp: StalenessInput, *, keep: int = 1) -> StalenessOutput:
    """User policy outside moerl: keep every other group, counted as 'odd'."""
    return StalenessOutput(keep_Q=np.arange(inp.staleness_Q.shape[0]) % 2 == keep, reason="odd")


# --- sampling order -------------------------------------------------------------------


def test_sampling_policies_by_hand():
    inp = SamplingInput(
        min_versions_Q=np.array([0, 2, 1, 2]), arrival_Q=np.array([5, 6, 7, 4]), current_version=2
    )
    assert build_sampling("fifo")(inp).order_Q.tolist() == [3, 0, 1, 2]
    assert build_sampling("freshest")(inp).order_Q.tolist() == [3, 1, 2, 0]


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [("fifo", ["a", "b", "c", "d", "e"]), ("freshest", ["b", "d", "c", "e", "a"])],
)
def test_get_batch_order(sampling, expected):
    async def run():
        buf = RolloutBuffer(
            BufferConfig(max_groups=8, sampling=SAMPLING_OPTIONS[sampling]()),
            DropStaleConfig(max_staleness=100),
        )
        # "e" holds tokens of versions 3 and 1: its oldest token (1) decides, as for "c".
        for gid, versions in [("a", [0]), ("b", [2]), ("c", [1]), ("d", [2]), ("e", [3, 1])]:
            await buf.put(make_group(gid, versions))
        first = await buf.get_batch(2, current_version=3)
        rest = await buf.get_batch(3, current_version=3)
        return gids(first) + gids(rest)

    assert asyncio.run(run()) == expected


# --- staleness ------------------------------------------------------------------------


def test_drop_above_max_staleness_and_metrics():
    async def run():
        buf = buffer(max_groups=4, staleness=DropStaleConfig(max_staleness=1))
        for gid, v in [("old", 0), ("mid", 1), ("new", 2)]:
            await buf.put(make_group(gid, [v, v + 1]))
        assert buf.metrics()["buffer/occupancy"] == 3 / 4
        # At version 2: staleness 2, 1, 0 → "old" is dropped, the others are taken.
        batch = await buf.get_batch(2, current_version=2)
        return gids(batch), buf.metrics(), buf.metrics()

    got, m, m_next = asyncio.run(run())
    assert got == ["mid", "new"]
    assert m["buffer/occupancy"] == 0.0
    assert m["buffer/dropped"] == 1.0 and m["buffer/dropped/stale"] == 1.0
    assert m["buffer/consumed"] == 2.0
    assert m["buffer/staleness/0"] == 1.0 and m["buffer/staleness/1"] == 1.0
    assert m["buffer/staleness_max"] == 1.0 and m["buffer/staleness_mean"] == 0.5
    assert "buffer/staleness/2" not in m
    # The window resets; totals stay.
    assert m_next["buffer/dropped"] == 0.0 and m_next["buffer/dropped_total"] == 1.0
    assert m_next["buffer/consumed"] == 0.0 and m_next["buffer/consumed_total"] == 2.0
    assert m_next["buffer/staleness_max"] == 0.0


def test_get_waits_when_drops_leave_too_few():
    async def run():
        buf = buffer(staleness=DropStaleConfig(max_staleness=0))
        await buf.put(make_group("stale", [0]))
        await buf.put(make_group("fresh", [1]))
        task = asyncio.create_task(buf.get_batch(2, current_version=1))
        await settle()
        assert not task.done() and len(buf) == 1  # "stale" dropped while waiting
        await buf.put(make_group("fresh2", [1]))
        return gids(await asyncio.wait_for(task, 5))

    assert asyncio.run(run()) == ["fresh", "fresh2"]


def test_correct_never_drops():
    async def run():
        buf = buffer(staleness=CorrectStaleConfig(max_staleness=0))
        await buf.put(make_group("ancient", [0]))
        batch = await buf.get_batch(1, current_version=5)
        return gids(batch), buf.metrics()

    got, m = asyncio.run(run())
    assert got == ["ancient"]
    assert m["buffer/dropped"] == 0.0 and m["buffer/staleness_max"] == 5.0


def test_custom_staleness_target():
    spec = CustomStalenessConfig(
        _target_=f"{__name__}.keep_odd_groups", options={"keep": 0}, throttle=False
    )

    async def run():
        buf = buffer(staleness=spec)
        for gid in "abcd":
            await buf.put(make_group(gid, [0]))
        return gids(await buf.get_batch(2, current_version=0)), buf.metrics()

    got, m = asyncio.run(run())
    assert got == ["a", "c"] and m["buffer/dropped/odd"] == 2.0


# --- backpressure ---------------------------------------------------------------------


def test_put_blocks_until_get_frees_space():
    now = [0.0]  # a clock the test moves by hand

    async def run():
        buf = buffer(max_groups=2, clock=lambda: now[0])
        await buf.put(make_group("a", [0]))
        await buf.put(make_group("b", [0]))
        blocked = asyncio.create_task(buf.put(make_group("c", [0])))
        await settle()
        assert not blocked.done() and len(buf) == 2
        now[0] = 2.5
        assert gids(await buf.get_batch(1, current_version=0)) == ["a"]
        await asyncio.wait_for(blocked, 5)
        return gids(await buf.get_batch(2, current_version=0)), buf.metrics()

    got, m = asyncio.run(run())
    assert got == ["b", "c"]
    assert m["buffer/put_wait_s"] == 2.5 and m["buffer/put_wait_s_total"] == 2.5
    assert m["buffer/get_wait_s"] == 0.0


def test_reservations_hold_capacity_and_release_frees_it():
    async def run():
        buf = buffer(max_groups=2)
        first, second = await buf.reserve(), await buf.reserve()
        third = asyncio.create_task(buf.reserve())
        await settle()
        assert not third.done() and buf.metrics()["buffer/in_flight"] == 2.0
        buf.release(first)  # its generation failed
        slot = await asyncio.wait_for(third, 5)
        await buf.put(make_group("x", [0]), second)
        with pytest.raises(ValueError, match="already used"):
            await buf.put(make_group("y", [0]), second)
        buf.release(slot)
        return buf.metrics()

    m = asyncio.run(run())
    assert m["buffer/in_flight"] == 0.0 and m["buffer/groups"] == 1.0


def test_get_wait_seconds():
    now = [0.0]  # a clock the test moves by hand

    async def run():
        buf = buffer(clock=lambda: now[0])
        task = asyncio.create_task(buf.get_batch(1, current_version=0))
        await settle()
        now[0] = 1.5
        await buf.put(make_group("a", [0]))
        await asyncio.wait_for(task, 5)
        return buf.metrics()

    m = asyncio.run(run())
    assert m["buffer/get_wait_s"] == 1.5 and m["buffer/get_wait_s_total"] == 1.5


# --- throttle: max_staleness=0 is synchronous RL -------------------------------------


def run_loop(max_staleness: int, steps: int = 3, per_step: int = 2) -> tuple[list, dict]:
    """A producer that generates with the newest version and a trainer; returns the log."""
    log: list[tuple[str, int]] = []

    async def run():
        buf = buffer(staleness=DepthConfig(max_staleness=max_staleness), groups_per_step=per_step)

        async def producer():
            for n in itertools.count():  # only the throttle holds it back
                slot = await buf.reserve()
                version = buf.version  # the engines hold the trainer's newest weights
                log.append(("gen", version))
                await buf.put(make_group(f"g{n}", [version]), slot)

        gen = asyncio.create_task(producer())
        for step in range(steps):
            batch = await asyncio.wait_for(buf.get_batch(per_step, current_version=step), 5)
            log.append(("train", step))
            assert all(g[0].versions.min() >= step - max_staleness for g in batch)
        buf.close()
        with pytest.raises(BufferClosed):
            await asyncio.wait_for(gen, 5)
        return buf.metrics()

    return log, asyncio.run(run())


def test_max_staleness_zero_is_synchronous():
    log, m = run_loop(max_staleness=0)
    assert log == [
        ("gen", 0), ("gen", 0), ("train", 0),
        ("gen", 1), ("gen", 1), ("train", 1),
        ("gen", 2), ("gen", 2), ("train", 2),
    ]  # fmt: skip
    assert m["buffer/dropped_total"] == 0.0 and m["buffer/staleness_max"] == 0.0
    assert m["buffer/consumed_total"] == 6.0


def test_max_staleness_one_runs_one_step_ahead():
    log, m = run_loop(max_staleness=1)
    # Two steps' worth is generated before the first step trains, none of it dropped.
    assert log[:5] == [("gen", 0)] * 4 + [("train", 0)]
    assert m["buffer/dropped_total"] == 0.0 and m["buffer/staleness_max"] == 1.0


# --- checkpoints and shutdown ---------------------------------------------------------


def test_state_dict_round_trip():
    async def run():
        def make() -> RolloutBuffer:
            cfg = BufferConfig(max_groups=8, sampling=FreshestConfig())
            return RolloutBuffer(cfg, DropStaleConfig(max_staleness=1))

        buf = make()
        for gid, v in [("old", 0), ("a", 2), ("b", 1), ("c", 2)]:
            await buf.put(make_group(gid, [v, v]))
        await buf.get_batch(1, current_version=2)  # drops "old", takes "a"
        state = json.loads(json.dumps(buf.state_dict()))  # JSON-safe
        restored = make()
        restored.load_state_dict(state)
        assert restored.version == 2 and len(restored) == 2
        batch = await restored.get_batch(2, current_version=2)
        return batch, restored.metrics()

    batch, m = asyncio.run(run())
    assert gids(batch) == ["c", "b"]  # freshest order survives the reload
    traj = batch[1][1]
    assert traj.versions.tolist() == [1, 1] and traj.reward == 2.0 and traj.index == 1
    assert m["buffer/consumed_total"] == 3.0 and m["buffer/dropped_total"] == 1.0
    assert m["buffer/consumed"] == 2.0


def test_close_wakes_waiters():
    async def run():
        buf = buffer(max_groups=1)
        await buf.put(make_group("a", [0]))
        blocked_put = asyncio.create_task(buf.put(make_group("b", [0])))
        other = buffer()
        blocked_get = asyncio.create_task(other.get_batch(1, current_version=0))
        await settle()
        buf.close()
        other.close()
        for task in (blocked_put, blocked_get):
            with pytest.raises(BufferClosed, match="closed"):
                await asyncio.wait_for(task, 5)
        with pytest.raises(BufferClosed):
            await buf.get_batch(1, current_version=0)
        return len(buf), buf.state_dict()

    remaining, state = asyncio.run(run())
    assert remaining == 1 and len(state["groups"]) == 1  # kept for the checkpoint


# --- config errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: buffer(max_groups=0), r"buffer\.max_groups=0 must be >= 1"),
        (
            lambda: buffer(staleness=DropStaleConfig(max_staleness=-1)),
            r"staleness\.max_staleness=-1 must be >= 0",
        ),
        (
            lambda: buffer(staleness=StalenessConfig(name="newest")),
            r"staleness: unknown staleness policy 'newest'",
        ),
        (lambda: buffer(staleness=DepthConfig()), r"needs groups_per_step"),
        (
            lambda: buffer(max_groups=2, staleness=DepthConfig(), groups_per_step=4),
            r"buffer\.max_groups=2 is smaller than the 4 groups",
        ),
    ],
)
def test_bad_config(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_calls():
    async def run():
        buf = buffer(max_groups=2)
        with pytest.raises(ValueError, match="has no reward"):
            await buf.put(make_group("a", [0], reward=None))
        with pytest.raises(ValueError, match="non-empty list"):
            await buf.put([])
        with pytest.raises(ValueError, match=r"1\.\.buffer\.max_groups=2"):
            await buf.get_batch(3, current_version=0)
        buf.set_version(3)
        with pytest.raises(ValueError, match="went back from 3 to 2"):
            await buf.get_batch(1, current_version=2)
        sync = buffer(staleness=DepthConfig(max_staleness=0), groups_per_step=1)
        await sync.put(make_group("a", [0]))
        await sync.get_batch(1, current_version=0)
        with pytest.raises(ValueError, match="would take 2 groups at version 0"):
            await sync.get_batch(1, current_version=0)

    asyncio.run(run())


# --- Hydra ----------------------------------------------------------------------------


def test_yaml_options_compose():
    from moerl.config.store import register_configs

    register_configs()
    cs = ConfigStore.instance()
    # The lead wires these into moerl.config.store; stored here so the YAML can be checked.
    cs.store(group="buffer", name="base_buffer", node=BufferConfig, provider="moerl")
    cs.store(group="staleness", name="base_staleness", node=StalenessConfig, provider="moerl")
    register_buffer_configs(cs)
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        cfg = compose(overrides=["+staleness=sync", "+buffer=default", "buffer/sampling=freshest"])
        staleness = OmegaConf.to_object(cfg.staleness)
        assert isinstance(staleness, DepthConfig) and staleness.max_staleness == 0
        assert isinstance(OmegaConf.to_object(cfg.buffer.sampling), FreshestConfig)
        for name in ("drop", "depth", "correct"):
            cfg = compose(overrides=[f"+staleness={name}", "+buffer=default"])
            buf = RolloutBuffer(cfg.buffer, cfg.staleness, groups_per_step=2)
            assert buf.staleness_cfg.name == name
        with pytest.raises(Exception, match="max_stalenes"):
            compose(overrides=["+staleness=drop", "staleness.max_stalenes=2"])
