"""The rollout orchestrator against real embedded engines, a real RolloutBuffer and real
tasks: groups reach the buffer scored, the cursor resumes exactly, the filter drops
uniform groups, each partial-rollout mode around a weight-version bump, failover."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from omegaconf import OmegaConf

from moerl.config.buffer import BufferConfig, StalenessConfig
from moerl.config.rollout import RolloutConfig
from moerl.parallel.spawn import free_port
from moerl.rollout import EngineClient
from moerl.rollout.buffer import RolloutBuffer
from moerl.rollout.decode import decode_routed_experts
from moerl.rollout.errors import EngineError
from moerl.rollout.orchestrator import Orchestrator, make_client
from moerl.rollout.partial import route_versions
from moerl.tasks.base import Prompt
from moerl.telemetry.timeline import Timeline, load_timeline

L, K = 4, 4  # the tiny DeepSeek model: 4 hidden layers, top-4 routing
CFG = RolloutConfig(group_size=2, max_inflight_groups=2, max_new_tokens=8, top_k=20)
LONG = 96  # tokens of a completion that is still running when the test intervenes


class EvenTokens:
    """Prompt i is 4 tokens derived from i; reward = fraction of even response ids."""

    def __init__(self, num_prompts: int | None = None) -> None:
        self.num_prompts = num_prompts

    def prompts(self, start: int = 0) -> Iterator[Prompt]:
        i = start
        while self.num_prompts is None or i < self.num_prompts:
            yield Prompt(i, np.array([3 + (7 * i + j) % 100 for j in range(4)], np.int32))
            i += 1

    def reward(self, prompt: Prompt, traj) -> float:  # type: ignore[no-untyped-def]
        return float(np.mean(traj.response_ids % 2 == 0)) if traj.response_len else 0.0


class HalfUniform(EvenTokens):
    """Async reward: the same for every completion of an even prompt (a uniform group)."""

    async def reward(self, prompt: Prompt, traj) -> float:  # type: ignore[no-untyped-def]
        await asyncio.sleep(0)
        return 0.5 if prompt.prompt_id % 2 == 0 else float(traj.index)


class NeverOdd(EvenTokens):
    """Odd prompts' scoring ends only by cancellation, so the even one of each pair is the
    group that finishes first (and the run hangs, failing, if an odd group is awaited)."""

    async def reward(self, prompt: Prompt, traj) -> float:  # type: ignore[no-untyped-def]
        if prompt.prompt_id % 2:
            await asyncio.Event().wait()
        return super().reward(prompt, traj)


class RecordingClient(EngineClient):
    """An EngineClient that keeps every /generate response it received."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.responses: list[dict] = []

    async def generate(self, input_ids, sampling_params, **kwargs):  # type: ignore[no-untyped-def]
        out = await super().generate(input_ids, sampling_params, **kwargs)
        for one in out if isinstance(out, list) else [out]:  # a list for n > 1
            self.responses.append({"input_ids": list(np.asarray(input_ids)), **one})
        return out


def new_buffer(max_groups: int = 8) -> RolloutBuffer:
    return RolloutBuffer(BufferConfig(max_groups=max_groups), StalenessConfig(throttle=False))


async def drive(orch: Orchestrator, body):  # type: ignore[no-untyped-def]
    """Run the orchestrator beside `body()`, then stop it; return body's result."""
    runner = asyncio.create_task(orch.run())
    try:
        return await asyncio.wait_for(body(), 60)
    finally:
        await orch.stop()
        await runner
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not rest, f"tasks left pending: {rest}"


async def wait_until(ready, what: str) -> None:  # type: ignore[no-untyped-def]
    """Return once ``await ready()`` holds (polled, 30 s at most)."""
    for _ in range(15000):
        if await ready():
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"never {what}")


async def wait_running(client: EngineClient, url: str, n: int) -> None:
    async def running() -> bool:
        return (await client.server_info())[url]["running_requests"] >= n

    await wait_until(running, f"{n} requests running")


def positions(groups) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted(g[0].group_id for g in groups)


def test_untruncated_sampling_asks_for_no_mask(ds_engine, tiny_checkpoints):
    """Sampling that keeps every token (temperature 1, no top_k / top_p / min_p): the
    engine's kept set is the whole vocabulary at every position, so the orchestrator asks
    for none and the trajectories carry none (the trainer normalises over the vocabulary,
    tests/unit/test_logprobs.py); truncated sampling still records it."""
    from moerl.models.tokenizer import build_tiny_tokenizer
    from moerl.tasks import build_task

    task = build_task("copy_digits", build_tiny_tokenizer())
    plain = replace(CFG, top_k=-1)
    assert not plain.records_sampling_mask() and CFG.records_sampling_mask()

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            answer = await client.generate(
                [3, 5, 7], plain.sampling_params(), return_sampling_mask=True,
                sampling_logprobs_mode="selected",
            )  # fmt: skip
            buffer = new_buffer()
            orch = Orchestrator(client, task, buffer, plain, num_layers=L, topk=K)
            groups = await drive(orch, lambda: buffer.get_batch(2, 0))
            return answer, groups

    answer, groups = asyncio.run(go())
    meta = answer["meta_info"]
    config = json.loads((tiny_checkpoints["deepseek_moe"] / "config.json").read_text())
    for row in meta["output_token_sampling_mask"]:
        assert sorted(row) == list(range(config["vocab_size"]))  # every token kept
    full = [e[0] for e in meta["output_token_logprobs"]]
    np.testing.assert_allclose(meta["output_token_sampling_logprobs"], full, atol=1e-5)
    for traj in (t for g in groups for t in g):
        assert traj.mask_ids is None and traj.mask_offsets is None
        assert traj.routed_experts is not None  # routes are still recorded


@pytest.mark.parametrize("group_request", [True, False])
def test_groups_reach_buffer_scored(ds_engine, tmp_path, group_request):
    """A group is one /generate with n (rids {group}-n_{i}) or n requests ({group}-{i})."""
    from moerl.models.tokenizer import build_tiny_tokenizer
    from moerl.tasks import build_task

    task = build_task("copy_digits", build_tiny_tokenizer())
    timeline = Timeline(tmp_path, "orchestrator")

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            buffer = new_buffer()
            cfg = replace(CFG, group_request=group_request)
            orch = Orchestrator(client, task, buffer, cfg, num_layers=L, topk=K, timeline=timeline)
            groups = await drive(orch, lambda: buffer.get_batch(3, 0))
            return groups, orch.metrics(), orch.state_dict()

    groups, metrics, state = asyncio.run(go())
    timeline.close()
    for group in groups:
        assert [t.index for t in group] == [0, 1]
        assert len({t.group_id for t in group}) == 1
        for traj in group:
            assert 0.0 <= traj.reward <= 1.0
            assert traj.meta["prompt_id"] == traj.group_id
            assert traj.mask_offsets is not None and traj.routed_experts is not None
            traj.validate(num_layers=L, topk=K, num_experts=8)
            suffix = f"-n_{traj.index}" if group_request else f"-{traj.index}"
            assert traj.meta["rid"].endswith(suffix), traj.meta["rid"]
    assert metrics["rollout/groups_done"] >= 3 and metrics["rollout/tokens"] >= 3 * 2
    assert metrics["rollout/gen_s"] > 0 and metrics["rollout/retries"] == 0
    assert state["cursor"] + len(state["settled"]) >= 3
    spans = [s for s in load_timeline(tmp_path) if s["kind"] == "generate"]
    assert {s["group"] for s in spans} >= {g[0].group_id for g in groups}


def test_cursor_resumes_without_repeats_or_gaps(ds_engine):
    """Run 1 fills a 3-group buffer and is stopped; run 2 resumes from its state and
    finishes the 7-prompt task. Every prompt reaches a buffer exactly once."""

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            first = new_buffer(max_groups=3)
            orch = Orchestrator(client, EvenTokens(7), first, CFG, num_layers=L, topk=K)

            async def full() -> None:
                while len(first) < 3:
                    await asyncio.sleep(0.01)

            await drive(orch, full)
            state = orch.state_dict()
            second = new_buffer()
            resumed = Orchestrator(client, EvenTokens(7), second, CFG, num_layers=L, topk=K)
            resumed.load_state_dict(state)
            await asyncio.wait_for(resumed.run(), 60)  # returns once the task is used up
            rest = await second.get_batch(len(second), 0)
            # a resume from an explicit position skips nothing before it
            skip = Orchestrator(
                client, EvenTokens(7), new_buffer(), CFG, num_layers=L, topk=K, start_cursor=2
            )
            skip.load_state_dict({"cursor": 2, "settled": [3, 5]})
            await asyncio.wait_for(skip.run(), 60)
            return await first.get_batch(3, 0), rest, resumed.cursor, skip

    before, after, cursor, skip = asyncio.run(go())
    assert sorted(positions(before) + positions(after)) == list(range(7))
    assert cursor == 7
    assert skip.cursor == 7 and skip.buffer.metrics()["buffer/groups"] == 3.0
    assert skip.metrics()["rollout/groups_done"] == 3  # positions 2, 4 and 6


def test_uniform_groups_are_filtered_and_counted(ds_engine):
    cfg = replace(CFG, filter_uniform_groups=True)

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            buffer = new_buffer()
            orch = Orchestrator(client, HalfUniform(6), buffer, cfg, num_layers=L, topk=K)
            await asyncio.wait_for(orch.run(), 60)
            return await buffer.get_batch(len(buffer), 0), orch.metrics(), orch.cursor

    groups, metrics, cursor = asyncio.run(go())
    assert positions(groups) == [1, 3, 5]
    assert metrics["rollout/groups_filtered"] == 3 and metrics["rollout/groups_done"] == 3
    assert cursor == 6


def test_oversampling_keeps_the_first_groups_of_each_round(ds_engine):
    """Rounds of 2 groups keeping 1: the odd prompts, whose scoring never ends, are
    cancelled."""
    cfg = replace(CFG, max_inflight_groups=1, oversample_factor=2.0)

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            buffer = new_buffer()
            orch = Orchestrator(client, NeverOdd(4), buffer, cfg, num_layers=L, topk=K)
            await asyncio.wait_for(orch.run(), 60)
            slots = buffer.metrics()["buffer/in_flight"]
            return await buffer.get_batch(len(buffer), 0), orch.metrics(), orch.cursor, slots

    groups, metrics, cursor, slots = asyncio.run(go())
    assert positions(groups) == [0, 2] and cursor == 4 and slots == 0
    assert metrics["rollout/groups_cancelled"] == 2 and metrics["rollout/groups_done"] == 2


@pytest.mark.parametrize("group_request", [True, False])
def test_abort_resume_splices_one_trajectory_across_versions(ds_engine, group_request):
    cfg = replace(
        CFG, max_new_tokens=LONG, ignore_eos=True, partial_rollout="abort_resume",
        group_request=group_request,
    )  # fmt: skip

    async def go():  # type: ignore[no-untyped-def]
        async with RecordingClient([ds_engine.url]) as client:
            old = int((await client.model_info())[ds_engine.url]["weight_version"])
            buffer = new_buffer()
            orch = Orchestrator(client, EvenTokens(1), buffer, cfg, num_layers=L, topk=K)

            async def update():  # type: ignore[no-untyped-def]
                await wait_running(client, ds_engine.url, 2)
                await orch.before_update()
                await client.update_weight_version(old + 1)
                await orch.after_update(old + 1)
                return await buffer.get_batch(1, old + 1)

            (group,) = await drive(orch, update)
            return old, group, client.responses, orch.metrics()

    old, group, responses, metrics = asyncio.run(go())
    aborted = {r["meta_info"]["id"]: r for r in responses if r["meta_info"]["finish_reason"]["type"] == "abort"}  # fmt: skip
    assert metrics["rollout/resumed"] == 2 and len(aborted) == 2
    for traj in group:
        traj.validate(num_layers=L, topk=K, num_experts=8)
        P, R = traj.prompt_len, traj.response_len
        assert R == LONG and traj.finish_reason == "length"
        head_seg, tail_seg = traj.meta["requests"]
        r1 = head_seg["end"]
        assert 0 < r1 < LONG and tail_seg == {**tail_seg, "start": r1, "end": LONG}
        assert np.all(traj.versions[:r1] == old) and np.all(traj.versions[r1:] == old + 1)
        head = aborted[head_seg["rid"]]
        assert traj.response_ids[:r1].tolist() == head["output_ids"]
        lp = [e[0] for e in head["meta_info"]["output_token_logprobs"]]
        assert np.allclose(traj.response_logprobs[:r1], lp)
        head_routes = decode_routed_experts(
            head["meta_info"]["routed_experts"], rows=P + r1 - 1, num_layers=L, topk=K
        )
        assert np.array_equal(traj.routed_experts[: P + r1 - 1], head_routes)
        (tail,) = [r for r in responses if r["meta_info"]["id"] == tail_seg["rid"]]
        assert tail["input_ids"] == traj.prompt_ids.tolist() + head["output_ids"]
        tail_routes = decode_routed_experts(
            tail["meta_info"]["routed_experts"], rows=LONG - r1, num_layers=L, topk=K
        )
        assert np.array_equal(traj.routed_experts[P + r1 - 1 :], tail_routes)
        assert traj.mask_offsets[-1] == traj.mask_ids.shape[0]
        row_versions = route_versions(traj)
        assert np.all(row_versions[: P + r1 - 1] == old)
        assert np.all(row_versions[P + r1 - 1 :] == old + 1)


async def in_place_run(client: EngineClient, url: str, pause: bool | str = "auto"):  # type: ignore[no-untyped-def]
    """(the engine's weight version, a buffer, an in_place orchestrator of one long
    group on it; ``pause``: rollout.in_place_pause)."""
    cfg = replace(
        CFG, max_new_tokens=LONG, ignore_eos=True, partial_rollout="in_place", in_place_pause=pause
    )
    old = int((await client.model_info())[url]["weight_version"])
    buffer = new_buffer()
    return old, buffer, Orchestrator(client, EvenTokens(1), buffer, cfg, num_layers=L, topk=K)


def test_in_place_versions_change_mid_response(ds_engine):
    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            old, buffer, orch = await in_place_run(client, ds_engine.url)

            async def update():  # type: ignore[no-untyped-def]
                await wait_running(client, ds_engine.url, 2)
                await orch.before_update()  # pauses the engines in place
                await client.update_weight_version(old + 1)
                await orch.after_update(old + 1)
                return await buffer.get_batch(1, old + 1)

            (group,) = await drive(orch, update)
            return old, group, orch.metrics()

    old, group, metrics = asyncio.run(go())
    assert metrics["rollout/resumed"] == 0
    for traj in group:
        traj.validate(num_layers=L, topk=K, num_experts=8)
        assert traj.response_len == LONG and "requests" not in traj.meta
        switch = int(np.argmax(traj.versions == old + 1))
        assert 0 < switch < LONG
        assert np.all(traj.versions[:switch] == old) and np.all(traj.versions[switch:] == old + 1)


def test_drain_waits_for_inflight_groups(ds_engine):
    cfg = replace(CFG, max_new_tokens=32, ignore_eos=True, partial_rollout="drain")

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            old = int((await client.model_info())[ds_engine.url]["weight_version"])
            buffer = new_buffer()
            orch = Orchestrator(client, EvenTokens(), buffer, cfg, num_layers=L, topk=K)

            async def parked() -> bool:
                """Groups 0 and 1 are in the buffer and the launcher holds the next
                prompt's slot: it reserves one, then waits for the gate to launch."""
                return len(buffer) >= 2 and buffer.metrics()["buffer/in_flight"] >= 1

            async def update():  # type: ignore[no-untyped-def]
                await wait_running(client, ds_engine.url, 2)
                await orch.before_update()  # returns once groups 0 and 1 are generated
                idle = (await client.server_info())[ds_engine.url]["running_requests"]
                await wait_until(parked, "the launcher waiting at the drained gate")
                # nothing launched while drained: one slot held, no group generating
                still = (orch.generating, buffer.metrics()["buffer/in_flight"])
                await client.update_weight_version(old + 1)
                await orch.after_update(old + 1)
                return idle, still, await buffer.get_batch(4, old + 1)

            return old, await drive(orch, update)

    old, (idle, still, groups) = asyncio.run(go())
    assert idle == 0 and still == (0, 1)
    assert {0, 1} <= set(positions(groups))
    for group in groups:  # no group spans the update
        for traj in group:
            assert np.all(traj.versions == (old if traj.group_id < 2 else old + 1))


def test_dead_engine_fails_over_and_lost_groups_come_back(ds_engine):
    dead = f"http://127.0.0.1:{free_port()}"

    async def go(max_retries: int):  # type: ignore[no-untyped-def]
        cfg = replace(CFG, max_retries=max_retries, group_retry_backoff_s=0.0)
        async with make_client([dead, ds_engine.url], cfg, retry_backoff_s=0.01) as client:
            buffer = new_buffer()
            orch = Orchestrator(client, EvenTokens(3), buffer, cfg, num_layers=L, topk=K)
            await asyncio.wait_for(orch.run(), 60)
            in_flight = buffer.metrics()["buffer/in_flight"]
            return await buffer.get_batch(3, 0), orch.metrics(), in_flight

    # retried on the live engine: every request is served there
    groups, metrics, _ = asyncio.run(go(max_retries=2))
    assert positions(groups) == [0, 1, 2] and metrics["rollout/retries"] >= 1
    assert all(t.meta["engine_url"] == ds_engine.url for g in groups for t in g)
    assert metrics["rollout/group_failures"] == 0
    # no retries: the first request (to the dead engine) fails its group, which comes back
    groups, metrics, in_flight = asyncio.run(go(max_retries=0))
    assert positions(groups) == [0, 1, 2] and metrics["rollout/group_failures"] >= 1
    assert in_flight == 0


def test_persistent_failure_stops_run_and_releases_slots():
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = replace(CFG, max_retries=0, max_group_attempts=2, group_retry_backoff_s=0.0)

    async def go():  # type: ignore[no-untyped-def]
        async with make_client([dead], cfg, retry_backoff_s=0.01) as client:
            buffer = new_buffer()
            orch = Orchestrator(client, EvenTokens(2), buffer, cfg, num_layers=L, topk=K)
            with pytest.raises(EngineError, match="failed 2 times"):
                await asyncio.wait_for(orch.run(), 60)
            return buffer.metrics(), orch.metrics()

    buffer_metrics, metrics = asyncio.run(go())
    assert buffer_metrics["buffer/in_flight"] == 0 and metrics["rollout/group_failures"] >= 2


def test_stop_aborts_requests_on_the_engine(ds_engine):
    cfg = replace(CFG, max_new_tokens=LONG, ignore_eos=True)

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            buffer = new_buffer()
            orch = Orchestrator(client, EvenTokens(), buffer, cfg, num_layers=L, topk=K)
            await drive(orch, lambda: wait_running(client, ds_engine.url, 2))
            await asyncio.sleep(0.05)
            return (await client.server_info())[ds_engine.url], buffer.metrics()

    info, buffer_metrics = asyncio.run(go())
    assert info["running_requests"] == 0 and info["waiting_requests"] == 0
    assert buffer_metrics["buffer/in_flight"] == 0


def test_config_yaml_and_validation():
    from importlib import resources

    raw = OmegaConf.load(str(resources.files("moerl.conf").joinpath("rollout", "default.yaml")))
    raw.pop("defaults")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RolloutConfig), raw))
    cfg.validate("rollout")
    assert replace(cfg, oversample_factor=1.5, max_inflight_groups=4).groups_per_round == 6
    with pytest.raises(ValueError, match="rollout.partial_rollout='later'"):
        replace(cfg, partial_rollout="later").validate("rollout")
    with pytest.raises(ValueError, match="group_size >= 2"):
        replace(cfg, group_size=1, filter_uniform_groups=True).validate("rollout")
    with pytest.raises(ValueError, match="oversample_factor"):
        replace(cfg, oversample_factor=0.5).validate("rollout")


class ControlRecording(EngineClient):
    """An EngineClient that records the pause/continue calls it sends (then sends them)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.controls: list[str] = []

    async def pause_generation(self, mode, **kwargs):  # type: ignore[no-untyped-def]
        self.controls.append(f"pause:{mode}")
        return await super().pause_generation(mode, **kwargs)

    async def continue_generation(self, **kwargs):  # type: ignore[no-untyped-def]
        self.controls.append("continue")
        return await super().continue_generation(**kwargs)


def test_in_place_update_pauses_the_engines_only_when_a_group_is_generating(ds_engine):
    """The synchronous loop pushes with nothing generating: the orchestrator closes its
    gates and sends no pause/continue (nothing would be held). With groups generating,
    the engines pause in place and continue after the push."""

    async def go():  # type: ignore[no-untyped-def]
        async with ControlRecording([ds_engine.url]) as client:
            old, buffer, orch = await in_place_run(client, ds_engine.url)
            gate = orch._gate
            await orch.before_update()  # nothing generating yet
            quiet = (list(client.controls), gate.launch_open.is_set(), gate.engines_open.is_set())
            await orch.after_update(old)
            reopened = gate.launch_open.is_set() and gate.engines_open.is_set()

            async def update():  # type: ignore[no-untyped-def]
                await wait_running(client, ds_engine.url, 2)
                await orch.before_update()
                paused = list(client.controls)
                await client.update_weight_version(old + 1)
                await orch.after_update(old + 1)
                await buffer.get_batch(1, old + 1)
                return paused

            busy = await drive(orch, update)
            return quiet, reopened, busy, client.controls

    quiet, reopened, busy, controls = asyncio.run(go())
    assert quiet == ([], False, False) and reopened
    assert busy == ["pause:in_place"] and controls == ["pause:in_place", "continue"]


@pytest.mark.parametrize("pause", ["auto", True])
def test_an_atomic_push_pauses_generation_only_where_asked(ds_engine, pause):
    """A push every engine loads at once (moerl/sync/publish.py ``atomic_push``): with
    rollout.in_place_pause=auto neither a quiet nor a busy push closes a gate or sends
    a pause, and the group generating goes on through it, its later tokens carrying the
    new version; in_place_pause=true pauses as for any push."""

    async def go():  # type: ignore[no-untyped-def]
        async with ControlRecording([ds_engine.url]) as client:
            old, buffer, orch = await in_place_run(client, ds_engine.url, pause)
            gate = orch._gate
            await orch.before_update(atomic=True)  # nothing generating yet
            quiet = (list(client.controls), gate.launch_open.is_set(), gate.engines_open.is_set())
            await orch.after_update(old)

            async def update():  # type: ignore[no-untyped-def]
                await wait_running(client, ds_engine.url, 2)
                await orch.before_update(atomic=True)
                busy = (list(client.controls), gate.launch_open.is_set())
                await client.update_weight_version(old + 1)
                await orch.after_update(old + 1)
                (group,) = await buffer.get_batch(1, old + 1)
                return busy, group

            busy, group = await drive(orch, update)
            return old, quiet, busy, group, client.controls

    old, quiet, busy, group, controls = asyncio.run(go())
    if pause == "auto":
        assert quiet == ([], True, True) and busy == ([], True) and controls == []
    else:
        assert quiet == ([], False, False) and busy == (["pause:in_place"], True)
        assert controls == ["pause:in_place", "continue"]
    for traj in group:
        switch = int(np.argmax(traj.versions == old + 1))
        assert 0 < switch < LONG and np.all(traj.versions[switch:] == old + 1)


def test_in_place_pause_takes_auto_true_or_false():
    for ok in ("auto", True, False):
        replace(CFG, in_place_pause=ok).validate("rollout")
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="in_place_pause=.*choose auto, true or false"):
            replace(CFG, in_place_pause=bad).validate("rollout")


class CountingTokens(EvenTokens):
    """EvenTokens that counts the prompts it made."""

    def __init__(self, num_prompts: int | None = None) -> None:
        super().__init__(num_prompts)
        self.made = 0

    def prompts(self, start: int = 0) -> Iterator[Prompt]:
        for prompt in super().prompts(start):
            self.made += 1
            yield prompt


def test_the_next_steps_prompts_are_made_while_a_synchronous_step_generates(ds_engine):
    """The synchronous loop (max_staleness=0, throttled): by the time a step's groups are
    in the buffer, the next step's prompts exist already (made once a group finished
    generating), so the launch at the next version only posts them; they go out in
    stream order, and ``sent()`` returns once their requests are out."""

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            old = int((await client.model_info())[ds_engine.url]["weight_version"])
            buffer = RolloutBuffer(
                BufferConfig(max_groups=4), StalenessConfig(max_staleness=0, throttle=True),
                groups_per_step=2, version=old,
            )  # fmt: skip
            task = CountingTokens()
            orch = Orchestrator(client, task, buffer, CFG, num_layers=L, topk=K)

            async def two_steps():  # type: ignore[no-untyped-def]
                first = await buffer.get_batch(2, old)
                made = task.made
                await client.update_weight_version(old + 1)  # the step's push
                buffer.set_version(old + 1)
                assert sum(client.outstanding.values()) == 0  # the launcher has not run
                await orch.sent()  # the loop's trainer thread waits for this
                assert sum(client.outstanding.values()) == 2  # both groups' requests
                second = await buffer.get_batch(2, old + 1)
                return first, made, second

            return await drive(orch, two_steps)

    first, made, second = asyncio.run(go())
    assert positions(first) == [0, 1]
    # the step's 2 groups and the next step's 2 (of a round made ahead, up to
    # groups_per_round, one of which the launcher may hold while the buffer is full);
    # without making them ahead, only the one the launcher took (3)
    assert made >= 2 + 2
    assert positions(second) == [2, 3]
