"""One episode: an environment and the policy taking turns, token in and token out, into
one Trajectory per role (docs/architecture.md, "Episodes").

# P the role's prompt tokens, R its response tokens (actions and spliced observations),
# L hidden layers, K experts per token

Each role's stream is a list of token ids. An observation is rendered on its own
(moerl.rollout.render) and appended; an action is a /generate request whose input_ids are
the stream so far, and its sampled ids are appended as the engine returned them. The
role's Trajectory: prompt = the stream before its first action; response = the rest up to
its last action's last token (later observations were never processed); loss_mask 1 on
the actions; segments for every action and observation.

Keep Routing across turns. Row t of the routes holds the experts token t was routed to by
the first forward that processed it, as in a single completion (moerl.rollout.partial):
the prompt and every observation from the prefill of the request that followed them, an
action's tokens from their decode steps. Each request asks only for the rows from
``routed_experts_start_len`` = the rows the stream has on: tokens already routed keep
their routes, whether the engine reused their KV from its prefix cache (it reports the
cached routes) or prefilled them again. Observation tokens carry the version of the
request that prefilled them, so ``route_versions`` and ``replay=recent`` read them as
they read an action's tokens.

Weight updates in the middle of an episode (rollout.partial_rollout):
- in_place: the turn in flight goes on; its later tokens and every later turn carry the
  new version;
- abort_resume: the aborted turn is dropped and generated again from the turn boundary
  once the engines serve the new weights (the earlier turns keep their versions);
- drain: the update waits for whole episodes (the orchestrator counts an episode as
  generating until it ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moerl.common.trajectory import Segment, Trajectory
from moerl.envs.base import POLICY_ROLE, Action, Env, Observation, Step
from moerl.rollout.client import ENGINE_URL_KEY, EngineClient
from moerl.rollout.decode import response_routes, trajectory_from_response
from moerl.rollout.errors import EngineError
from moerl.rollout.render import Renderer

MAX_TURN_RETRIES = 64
"""Aborted attempts of one turn before the episode counts as a failed request."""


@dataclass
class EpisodeSettings:
    """What every episode of a run shares."""

    sampling_params: Mapping[str, Any]
    max_turns: int
    max_tokens: int
    """Longest stream of a role (env.max_episode_tokens or the context length)."""
    routed_experts: bool = True
    sampling_mask: bool = True
    num_layers: int | None = None
    topk: int | None = None
    mode: str = "in_place"
    """rollout.partial_rollout."""


@dataclass
class EpisodeEnv:
    """The environment side of a run's episodes, as the rollout service builds it from
    the `env` config; the orchestrator adds the engine side (``runner``)."""

    make_env: Callable[[Any], Env]
    renderer: Renderer
    max_turns: int
    max_tokens: int

    def runner(
        self,
        client: EngineClient,
        sampling_params: Mapping[str, Any],
        cfg: Any,
        num_layers: int | None,
        topk: int | None,
        gate: asyncio.Event | None,
    ) -> EpisodeRunner:
        """An EpisodeRunner with the rollout config ``cfg`` (routes, mask, partial mode)."""
        settings = EpisodeSettings(
            sampling_params=sampling_params, max_turns=self.max_turns,
            max_tokens=self.max_tokens, routed_experts=cfg.return_routed_experts,
            sampling_mask=cfg.records_sampling_mask(), num_layers=num_layers, topk=topk,
            mode=cfg.partial_rollout,
        )  # fmt: skip
        return EpisodeRunner(client, self.make_env, self.renderer, settings, gate=gate)


@dataclass
class RoleStream:
    """One role's token stream and what the trainer needs of it: ``observe`` appends
    tokens it did not generate, ``commit`` a finished turn, ``trajectory()`` the record."""

    role: str
    ids: list[int] = field(default_factory=list)
    prompt_len: int | None = None  # set at the role's first action
    routes: list[np.ndarray] = field(default_factory=list)  # row blocks, in order
    rows: int = 0
    logprobs: list[np.ndarray] = field(default_factory=list)
    sampling: list[np.ndarray] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    mask_rows: list[list[int]] = field(default_factory=list)
    trained: list[np.ndarray] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    pending: list[tuple[list[int], str, int]] = field(default_factory=list)
    last_action: list[int] = field(default_factory=list)
    actions: int = 0
    early_reward: float = 0.0  # rewards given before the role's first action
    temperature: float = 1.0
    rids: list[str] = field(default_factory=list)
    masked: bool = True  # every turn came with its sampling mask

    @property
    def response_len(self) -> int:
        return 0 if self.prompt_len is None else len(self.ids) - self.prompt_len

    def observe(self, ids: list[int], source: str, turn: int) -> None:
        self.ids.extend(ids)
        if self.prompt_len is not None and ids:
            self.pending.append((ids, source, turn))

    def commit(self, turn: Trajectory, routes: np.ndarray | None, index: int) -> None:
        """Append one finished turn (its prompt is the stream so far)."""
        if self.prompt_len is None:
            self.prompt_len = len(self.ids)
        version = int(turn.versions[0]) if turn.response_len else 0
        for ids, source, k in self.pending:  # observations: prefilled by this request
            start = self._spliced(ids, version)
            self.segments.append(Segment(start, start + len(ids), source, k))
        self.pending.clear()
        start = self.response_len
        R = turn.response_len
        self.ids.extend(int(i) for i in turn.response_ids)
        self.logprobs.append(turn.response_logprobs)
        self.sampling.append(
            turn.sampling_logprobs if turn.sampling_logprobs is not None else turn.response_logprobs
        )
        self.versions.append(turn.versions)
        if turn.mask_ids is not None and turn.mask_offsets is not None:
            self.mask_rows.extend(turn.mask_row(t).tolist() for t in range(R))
        else:  # no mask recorded: the trajectory will have none
            self.masked = False
            self.mask_rows.extend([int(i)] for i in turn.response_ids)
        self.trained.append(np.ones(R, dtype=np.uint8))
        reward = None
        if not self.actions and self.early_reward:
            reward, self.early_reward = self.early_reward, 0.0
        self.segments.append(Segment(start, start + R, "policy", index, reward))
        if routes is not None:
            self.routes.append(routes)
            self.rows += routes.shape[0]
        self.last_action = [int(i) for i in turn.response_ids]
        self.actions += 1
        self.temperature = turn.temperature
        rid = turn.meta.get("rid")
        if rid is not None:
            self.rids.append(str(rid))

    def _spliced(self, ids: list[int], version: int) -> int:
        # the observation's ids are already in self.ids; the response starts at prompt_len
        assert self.prompt_len is not None
        start = sum(len(a) for a in self.logprobs)
        n = len(ids)
        self.logprobs.append(np.zeros(n, dtype=np.float32))
        self.sampling.append(np.zeros(n, dtype=np.float32))
        self.versions.append(np.full(n, version, dtype=np.int32))
        self.mask_rows.extend([int(i)] for i in ids)
        self.trained.append(np.zeros(n, dtype=np.uint8))
        return start

    def reward(self, value: float) -> None:
        """Add ``value`` to the role's latest action (before its first: to the first)."""
        if not self.actions:
            self.early_reward += value
            return
        seg = next(s for s in reversed(self.segments) if s.source == "policy")
        seg.reward = float(seg.reward or 0.0) + value

    def trajectory(self) -> Trajectory:
        """The role's record, up to its last action."""
        assert self.prompt_len is not None, "a role that never acted has no trajectory"
        R = sum(len(a) for a in self.logprobs)
        total = self.prompt_len + R
        policy = [s for s in self.segments if s.source == "policy"]
        mask_ids = mask_offsets = sampling = None
        if self.masked:
            counts = np.array([len(r) for r in self.mask_rows], dtype=np.int32)
            mask_ids = np.concatenate([np.asarray(r, dtype=np.int32) for r in self.mask_rows])
            mask_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            sampling = np.concatenate(self.sampling)
        routes = None
        if self.routes:
            routes = np.concatenate(self.routes, axis=0)[: max(total - 1, 0)]
        return Trajectory(
            prompt_ids=np.asarray(self.ids[: self.prompt_len], dtype=np.int32),
            response_ids=np.asarray(self.ids[self.prompt_len : total], dtype=np.int32),
            response_logprobs=np.concatenate(self.logprobs),
            versions=np.concatenate(self.versions),
            sampling_logprobs=sampling,
            routed_experts=routes,
            mask_ids=mask_ids,
            mask_offsets=mask_offsets,
            temperature=self.temperature,
            reward=float(sum(s.reward or 0.0 for s in policy)),
            loss_mask=np.concatenate(self.trained),
            segments=list(self.segments),
            role=self.role,
        )


@dataclass
class EpisodeStats:
    """What one episode measured (the orchestrator's episode/ metrics)."""

    turns: int = 0
    env_s: float = 0.0
    env_steps: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish: str = "done"
    retried_turns: int = 0
    cached_tokens: int = 0
    """Input tokens the engine reused from its prefix cache (meta_info.cached_tokens)."""


class EpisodeRunner:
    """Runs episodes of one environment factory against one engine client."""

    def __init__(
        self,
        client: EngineClient,
        make_env: Callable[[Any], Env],
        renderer: Renderer,
        settings: EpisodeSettings,
        *,
        gate: asyncio.Event | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """gate: set while the engines generate (abort_resume waits on it before a turn
        is generated again)."""
        self.client, self.make_env, self.renderer = client, make_env, renderer
        self.settings, self.gate, self.clock = settings, gate, clock

    async def run(
        self,
        prompt: Any,
        *,
        group_id: int | str | None = None,
        index: int | None = None,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> tuple[list[Trajectory], EpisodeStats]:
        """Play one episode of ``prompt``; one Trajectory per role of the environment
        (``env.roles``, default one 'policy' role), in that order."""
        env = self.make_env(prompt)
        roles = tuple(getattr(env, "roles", (POLICY_ROLE,)))
        streams = {r: RoleStream(r) for r in roles}
        stats = EpisodeStats()
        obs: Observation | None = await self._env(env.reset(), stats, env)
        turn, source = 0, "env"
        while obs is not None:
            stream = self._deliver(streams, obs, turn, source, env)
            if turn >= self.settings.max_turns:
                stats.finish = "turns"
                break
            budget = self.settings.max_tokens - len(stream.ids)
            max_new = min(int(self.settings.sampling_params["max_new_tokens"]), budget)
            if max_new < 1:
                stats.finish = "length"
                break
            sub_rid = None if rid is None else f"{rid}-t{turn}"
            result, routes = await self._turn(stream, max_new, sub_rid, lora_path, stats)
            stream.commit(result, routes, turn)
            stats.turns += 1
            text = self.renderer.tokenizer.decode(stream.last_action, skip_special_tokens=True)
            action = Action(stream.role, text, stream.last_action, result.finish_reason, turn)
            step: Step = await self._env(env.step(action), stats, env)
            stats.tool_calls += bool(step.info.get("tool_call"))
            stats.tool_errors += bool(step.info.get("tool_error"))
            self._reward(streams, stream.role, step.reward, env)
            turn += 1
            if step.done:
                break
            obs = step.observation
            source = "tool" if step.info.get("tool_call") else "env"
        close = getattr(env, "close", None)
        if close is not None:
            await close()
        silent = [r for r, s in streams.items() if s.prompt_len is None]
        if silent:
            raise ValueError(
                f"environment {type(env).__name__} ended an episode before role(s) "
                f"{silent} acted; every role in env.roles must act at least once (give "
                "each a turn, or declare fewer roles)"
            )
        trajs = []
        for k, role in enumerate(roles):
            t = streams[role].trajectory()
            t.group_id, t.index = group_id, index
            t.finish_reason = "stop" if stats.finish == "done" else "length"
            t.meta.update(
                rids=streams[role].rids, prompt_id=getattr(prompt, "prompt_id", None),
                episode={"index": index, "turns": stats.turns, "finish": stats.finish,
                         "roles": list(roles), "role_index": k,
                         "cached_tokens": stats.cached_tokens},
            )  # fmt: skip
            trajs.append(t.validate(num_layers=self.settings.num_layers, topk=self.settings.topk))
        return trajs, stats

    # ---- one turn -------------------------------------------------------------------

    async def _turn(
        self,
        stream: RoleStream,
        max_new: int,
        rid: str | None,
        lora_path: str | None,
        stats: EpisodeStats,
    ) -> tuple[Trajectory, np.ndarray | None]:
        """Generate one action on ``stream``; an aborted attempt (abort_resume) is
        dropped and generated again from the turn boundary once the gate opens."""
        s = self.settings
        params = {**s.sampling_params, "max_new_tokens": max_new}
        prompt = np.asarray(stream.ids, dtype=np.int32)
        for attempt in range(MAX_TURN_RETRIES + 1):
            if self.gate is not None:
                await self.gate.wait()
            sub = rid if rid is None or attempt == 0 else f"{rid}r{attempt}"
            response = await self.client.generate(
                prompt, params, return_logprob=True,
                return_routed_experts=s.routed_experts,
                routed_experts_start_len=stream.rows if s.routed_experts else None,
                return_sampling_mask=s.sampling_mask,
                sampling_logprobs_mode="selected" if s.sampling_mask else None,
                rid=sub, lora_path=lora_path,
            )  # fmt: skip
            if isinstance(response, list):
                raise EngineError("engine answered a single /generate with a list")
            url = response.get(ENGINE_URL_KEY)
            turn = trajectory_from_response(
                response, prompt, params, sampling_mask=s.sampling_mask, url=url
            )
            if turn.finish_reason != "abort":
                stats.cached_tokens += int(response["meta_info"].get("cached_tokens") or 0)
                if sub is not None:
                    turn.meta["rid"] = sub
                return turn, self._routes(response, stream, turn, url)
            stats.retried_turns += 1
        raise EngineError(f"a turn of {rid} was aborted {MAX_TURN_RETRIES} times; giving up")

    def _routes(
        self, response: Mapping[str, Any], stream: RoleStream, turn: Trajectory, url: str | None
    ) -> np.ndarray | None:
        if not self.settings.routed_experts:
            return None
        rows = max(turn.prompt_len + turn.response_len - 1, 0) - stream.rows
        return response_routes(
            response, rows=rows, num_layers=self.settings.num_layers, topk=self.settings.topk,
            url=url,
        )  # fmt: skip

    # ---- the environment ------------------------------------------------------------

    async def _env(self, call: Any, stats: EpisodeStats, env: Env) -> Any:
        start = self.clock()
        try:
            return await call
        except Exception as err:
            raise EnvError(f"environment {type(env).__name__} failed: {err!r}") from err
        finally:
            stats.env_s += self.clock() - start
            stats.env_steps += 1

    def _deliver(
        self, streams: dict[str, RoleStream], obs: Observation, turn: int, source: str, env: Env
    ) -> RoleStream:
        """Append ``obs`` (and its ``others``) to the streams; the stream that acts next.
        ``source``: 'tool' when the observation answers a tool call, else 'env'."""
        if obs.role not in streams:
            raise EnvError(
                f"environment {type(env).__name__} addressed role {obs.role!r}; its roles "
                f"are {list(streams)} (declare every role in the environment's `roles` attribute)"
            )
        for role, text in obs.others.items():
            if role not in streams:
                raise EnvError(f"environment {type(env).__name__} wrote to unknown role {role!r}")
            self._append(streams[role], text, None, "agent", turn)
        stream = streams[obs.role]
        self._append(stream, obs.text, obs.token_ids, source, turn)
        return stream

    def _append(self, stream: RoleStream, text: str, ids: Any, source: str, turn: int) -> None:
        if ids is not None:
            tokens = [int(i) for i in ids]
        elif not stream.ids:
            tokens = self.renderer.first(text)
        else:
            tokens = self.renderer.next(text, stream.last_action)
        stream.observe(tokens, source, turn - 1)

    def _reward(self, streams: dict[str, RoleStream], role: str, reward: Any, env: Env) -> None:
        if isinstance(reward, Mapping):
            for r, value in reward.items():
                if r not in streams:
                    raise EnvError(f"environment {type(env).__name__} rewarded unknown role {r!r}")
                streams[r].reward(float(value))
        else:
            streams[role].reward(float(reward))


class EnvError(RuntimeError):
    """The environment raised or broke its contract; retrying will not fix it."""
