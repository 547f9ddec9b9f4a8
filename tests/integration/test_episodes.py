"""Episodes against a real embedded engine: token in / token out on a BPE tokenizer, a
two-agent episode's per-role streams and rewards, and a weight update in the middle of an
episode under each partial-rollout mode (versions per token, behaviour logprobs)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from test_orchestrator import RecordingClient

from moerl.config.buffer import BufferConfig, StalenessConfig
from moerl.config.rollout import RolloutConfig
from moerl.envs.base import Observation, Step
from moerl.models.tokenizer import build_tiny_tokenizer
from moerl.rollout import EngineClient
from moerl.rollout.buffer import RolloutBuffer
from moerl.rollout.episode import EpisodeEnv, EpisodeRunner, EpisodeSettings
from moerl.rollout.orchestrator import Orchestrator
from moerl.rollout.partial import route_versions
from moerl.rollout.render import Renderer
from moerl.tasks.base import Prompt

L, K = 4, 4  # the tiny DeepSeek model: 4 hidden layers, top-4 routing
LONG = 96  # tokens of a turn that is still running when the test intervenes


def bpe_tokenizer():  # type: ignore[no-untyped-def]
    """A byte-pair tokenizer (merges such as '12' and 'ab') under the tiny model's 128 ids:
    decoding sampled ids and encoding the text again does not give the ids back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
        initial_alphabet=list("0123456789abcdefghijklmnopqrstuvwxyz:+-= "),
    )  # fmt: skip
    corpus = ["12 123 1234 ab abc abcd count next turn: 12ab ab12"] * 50
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>",
    )  # fmt: skip


class Countdown:
    """Single-agent: text observations each turn, reward 0.25 per action, `turns` actions.
    Counts steps across its instances (``steps``); with ``barrier`` set, the first step
    of each episode waits until ``barrier`` episodes arrived, so their second turns start
    together."""

    steps = 0
    barrier = 0
    arrived: asyncio.Event | None = None

    def __init__(self, prompt, turns: int = 3) -> None:  # type: ignore[no-untyped-def]
        self.turns, self.done = turns, 0

    async def reset(self) -> Observation:
        return Observation(text="count 1234 abc")

    async def step(self, action) -> Step:  # type: ignore[no-untyped-def]
        self.done += 1
        type(self).steps += 1
        return Step(
            Observation(text=f"next {self.done}2 ab"), reward=0.25, done=self.done >= self.turns
        )


class ProposerSolver:
    """Two roles on one policy: the proposer acts, the solver sees what it wrote and
    acts, the env rewards both and ends."""

    roles = ("proposer", "solver")

    def __init__(self, prompt) -> None:  # type: ignore[no-untyped-def]
        self.turn = 0

    async def reset(self) -> Observation:
        return Observation(text="propose: ", role="proposer")

    async def step(self, action) -> Step:  # type: ignore[no-untyped-def]
        self.turn += 1
        if action.role == "proposer":
            return Step(
                Observation(text=f"solve: {action.text[:8]}=", role="solver",
                            others={"proposer": "sent "}),
                reward=0.5,
            )  # fmt: skip
        return Step(None, reward={"solver": 1.0, "proposer": 0.25}, done=True)


def settings(**kw) -> EpisodeSettings:  # type: ignore[no-untyped-def]
    base = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 40}
    return EpisodeSettings(base, max_turns=8, max_tokens=400, num_layers=L, topk=K, **kw)


def test_turns_are_token_in_token_out(ds_engine):
    """Every turn's request is the stream so far (the earlier turns' ids as the engine
    returned them, not a re-tokenised decode), and the trajectory is the last request's
    input plus its output; decoding and encoding it again would give other ids."""
    tok = bpe_tokenizer()

    async def go():  # type: ignore[no-untyped-def]
        async with RecordingClient([ds_engine.url]) as client:
            runner = EpisodeRunner(client, Countdown, Renderer(tok), settings())
            (traj,), stats = await runner.run(Prompt(0, np.array([1])), group_id=0, index=0)
            return traj, stats, client.responses

    traj, stats, responses = asyncio.run(go())
    stream = traj.prompt_ids.tolist() + traj.response_ids.tolist()
    assert stats.turns == 3 and len(responses) == 3
    for r in responses:
        assert stream[: len(r["input_ids"])] == r["input_ids"]
        n = len(r["input_ids"])
        assert stream[n : n + len(r["output_ids"])] == r["output_ids"]
    last = responses[-1]
    assert stream == last["input_ids"] + last["output_ids"]
    assert tok(tok.decode(stream), add_special_tokens=False)["input_ids"] != stream
    # the observation between turns is the text encoded on its own
    obs = [s for s in traj.segments if s.source == "env"][0]
    assert (
        traj.response_ids[obs.start : obs.end].tolist()
        == tok("next 12 ab", add_special_tokens=False)["input_ids"]
    )
    assert traj.loss_mask[obs.start : obs.end].sum() == 0
    assert traj.reward == pytest.approx(0.75)
    assert [s.reward for s in traj.segments if s.source == "policy"] == [0.25] * 3


def test_two_agents_each_get_their_stream_mask_and_reward(ds_engine):
    tok = build_tiny_tokenizer()

    async def go():  # type: ignore[no-untyped-def]
        async with RecordingClient([ds_engine.url]) as client:
            runner = EpisodeRunner(client, ProposerSolver, Renderer(tok), settings())
            trajs, _ = await runner.run(Prompt(3, np.array([1])), group_id=3, index=1)
            return trajs, client.responses

    (proposer, solver), responses = asyncio.run(go())
    assert (proposer.role, solver.role) == ("proposer", "solver")
    assert proposer.group_id == solver.group_id == 3 and proposer.index == solver.index == 1
    prop_req, solve_req = responses
    # the proposer's record is its one action; what it was sent later was never processed
    assert proposer.prompt_ids.tolist() == prop_req["input_ids"]
    assert proposer.response_ids.tolist() == prop_req["output_ids"]
    assert proposer.loss_mask.all() and proposer.reward == pytest.approx(0.75)
    # the solver's prompt shows the proposal as text it did not generate
    assert solver.prompt_ids.tolist() == solve_req["input_ids"]
    assert solver.response_ids.tolist() == solve_req["output_ids"]
    assert solver.reward == pytest.approx(1.0)
    assert tok.decode(solver.prompt_ids, skip_special_tokens=True).startswith("solve: ")


# ---- a weight update in the middle of an episode --------------------------------------


class Task1:
    """One prompt; episodes do not use the task's reward."""

    def prompts(self, start: int = 0) -> Iterator[Prompt]:
        if start == 0:
            yield Prompt(0, np.array([5, 6, 7], np.int32))

    def reward(self, prompt, traj) -> float:  # type: ignore[no-untyped-def]
        raise AssertionError("episodes are scored by their environment")


@pytest.fixture(scope="module")
def long_engine(tiny_checkpoints, engine_factory, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tiny DeepSeek model with a 512-token context: three long turns fit."""
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    model = replace(tiny_config("deepseek_moe"), max_position_embeddings=512)
    path = save_tiny_checkpoint(model, tmp_path_factory.mktemp("long") / "ds", seed=0)
    return engine_factory(path, "--enable-return-routed-experts")


async def _mid_episode_update(url: str, mode: str):  # type: ignore[no-untyped-def]
    """Two episodes of 3 long turns; the version bumps while both second turns run."""
    cfg = RolloutConfig(
        group_size=2, max_inflight_groups=1, max_new_tokens=LONG, ignore_eos=True,
        top_k=20, partial_rollout=mode,
    )  # fmt: skip
    Countdown.steps, Countdown.barrier, Countdown.arrived = 0, 2, None
    episodes = EpisodeEnv(Countdown, Renderer(build_tiny_tokenizer()), max_turns=8, max_tokens=512)
    async with RecordingClient([url]) as client:
        old = int((await client.model_info())[url]["weight_version"])
        buffer = RolloutBuffer(BufferConfig(max_groups=4), StalenessConfig(throttle=False))
        orch = Orchestrator(client, Task1(), buffer, cfg, num_layers=L, topk=K, episodes=episodes)  # type: ignore[arg-type]
        runner = asyncio.create_task(orch.run())
        try:
            for _ in range(30000):  # both episodes took their first step: turn 1 runs
                if (
                    Countdown.steps >= 2
                    and (await client.server_info())[url]["running_requests"] >= 2
                ):
                    break
                await asyncio.sleep(0.001)
            else:
                raise AssertionError("the second turns never ran together")
            await orch.before_update()
            steps_at_push = Countdown.steps
            await client.update_weight_version(old + 1)
            await orch.after_update(old + 1)
            (group,) = await asyncio.wait_for(buffer.get_batch(1, old + 1), 120)
        finally:
            await orch.stop()
            await runner
        Countdown.barrier = 0
        return old, group, client.responses, orch.metrics(), steps_at_push


def _turn_versions(traj) -> list[set[int]]:  # type: ignore[no-untyped-def]
    return [
        set(traj.versions[s.start : s.end].tolist()) for s in traj.segments if s.source == "policy"
    ]


@pytest.mark.parametrize("mode", ["in_place", "abort_resume", "drain"])
def test_weight_update_mid_episode(long_engine, mode):
    old, group, responses, metrics, steps_at_push = asyncio.run(
        _mid_episode_update(long_engine.url, mode)
    )
    assert len(group) == 2 and metrics["episode/count"] == 2
    committed = {
        r["meta_info"]["id"]: r
        for r in responses
        if r["meta_info"]["finish_reason"]["type"] != "abort"
    }
    for traj in group:
        traj.validate(num_layers=L, topk=K, num_experts=8)
        turns = _turn_versions(traj)
        assert len(turns) == 3
        if mode == "drain":  # the push waited for whole episodes
            assert steps_at_push == 6 and all(v == {old} for v in turns)
            continue
        assert turns[0] == {old} and turns[2] == {old + 1}
        if mode == "in_place":  # the second turn spans the update
            assert turns[1] == {old, old + 1}
        else:  # abort_resume: the second turn was generated again from its boundary
            assert turns[1] == {old + 1}
        # observations carry the version of the request that prefilled them
        for seg in traj.segments:
            if seg.source == "env":
                nxt = traj.versions[seg.end]
                assert (traj.versions[seg.start : seg.end] == nxt).all()
        assert (route_versions(traj) >= old).all()
        # behaviour logprobs: each action's are those of the request that produced it
        for rid, seg in zip(traj.meta["rids"], [s for s in traj.segments if s.source == "policy"]):
            lp = [e[0] for e in committed[rid]["meta_info"]["output_token_logprobs"]]
            assert np.allclose(traj.response_logprobs[seg.start : seg.end], lp)
            assert traj.response_ids[seg.start : seg.end].tolist() == committed[rid]["output_ids"]
    if mode == "abort_resume":
        assert metrics["rollout/resumed"] == 2
        assert sum(r["meta_info"]["finish_reason"]["type"] == "abort" for r in responses) == 2


def test_an_episode_without_routes_or_mask_records_none(ds_engine):
    """rollout.return_routed_experts / return_sampling_mask off: the episode claims no
    routes and no mask (spliced positions do not make one up)."""

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            runner = EpisodeRunner(
                client, Countdown, Renderer(build_tiny_tokenizer()),
                settings(routed_experts=False, sampling_mask=False),
            )  # fmt: skip
            (traj,), _ = await runner.run(Prompt(0, np.array([1])), group_id=0, index=0)
            return traj

    traj = asyncio.run(go())
    assert traj.routed_experts is None and traj.mask_ids is None
    assert traj.sampling_logprobs is None and not traj.has_sampling_mask
    assert traj.num_trained < traj.response_len
