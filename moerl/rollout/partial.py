"""Partial rollouts: continue an aborted completion and splice it into one Trajectory.

# P prompt tokens, R response tokens (R1 before the abort, R2 after), L hidden layers,
# K experts per token, N mask nnz

A completion aborted by `pause_generation("abort")` (a weight update in
partial_rollout=abort_resume) comes back with the R1 tokens sampled so far. It is continued
by a new request whose input is prompt ++ partial response, with max_new_tokens reduced by
R1, and the two parts become one trajectory: response ids, logprobs, sampling logprobs,
versions (the old part keeps the old version) and the sampling-mask CSR are concatenated.

Routed experts. Row t of a trajectory's routes holds the experts token t was routed to in
the forward that first processed it. That forward is also the one that sampled response
token t - P + 1 (the prompt rows, from the prefill, sampled token 0), so

    row t was routed under versions[clip(t - P + 1, 0, R - 1)]           (route_versions)

in every partial-rollout mode. The continuation re-prefills the prefix under the new
weights, which routes rows [0, P + R1 - 1) a second time. Those new routes are dropped and
the recorded ones kept: they are the routes of the forwards that sampled the old tokens,
which Keep Routing must replay for the old tokens' logprobs to match the engine's (and the
IS correction compares against exactly those logprobs). The continuation asks only for
rows from routed_experts_start_len = P + R1 - 1 on: the last old token, never fed back
before the abort, first routed in the resumed prefill that sampled new token R1. This is
the layout SGLang's and moerl.engine's `retract` pause and in-place updates produce (each
token routed once, by the first forward that saw it). What it cannot express: the new
tokens were sampled after the prefix was re-routed under the new weights, so replaying old
routes for the prefix in their forward is an approximation, the same one a KV cache kept
across an in-place update makes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import numpy as np

from moerl.common.trajectory import Trajectory
from moerl.rollout.client import ENGINE_URL_KEY, EngineClient
from moerl.rollout.decode import response_routes, trajectory_from_response
from moerl.rollout.errors import EngineError

log = logging.getLogger(__name__)


def route_versions(traj: Trajectory) -> np.ndarray:
    """int32 [P+R-1]: the policy version each routed-experts row was computed under (-1
    without response tokens: no version was reported)."""
    P, R = traj.prompt_len, traj.response_len
    if R == 0:
        return np.full(max(P - 1, 0), -1, dtype=np.int32)
    rows_T = np.arange(max(P + R - 1, 0))
    return traj.versions[np.clip(rows_T - P + 1, 0, R - 1)].astype(np.int32)


def version_spans(versions_R: np.ndarray) -> list[dict[str, Any]]:
    """SGLang-style weight_versions spans [{version, start, end}] of a versions array."""
    spans: list[dict[str, Any]] = []
    for t, v in enumerate(versions_R.tolist()):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = t + 1
        else:
            spans.append({"version": str(v), "start": t, "end": t + 1})
    return spans


def _segment(traj: Trajectory, start: int) -> dict[str, Any]:
    return {
        "start": start,
        "end": start + traj.response_len,
        "rid": traj.meta.get("rid"),
        "engine_url": traj.meta.get("engine_url"),
        "finish_reason": traj.finish_reason,
    }


def splice(head: Trajectory, tail: Trajectory, tail_routes: np.ndarray | None) -> Trajectory:
    """One trajectory from an aborted head and its continuation `tail` (whose prompt is
    head's prompt ++ head's response). tail_routes: the continuation's rows from
    routed_experts_start_len = P + R1 - 1 on ([R2, L, K]); None when routes are off."""
    P, R1 = head.prompt_len, head.response_len
    if R1 == 0:
        raise ValueError(f"{head.name()}: nothing to splice onto, restart it instead")
    routes = None
    if head.routed_experts is not None:
        if tail_routes is None:
            raise ValueError(f"{head.name()} has routes but its continuation has none")
        routes = np.concatenate([head.routed_experts[: P + R1 - 1], tail_routes], axis=0)
    mask_ids = mask_offsets = None
    if head.mask_ids is not None and head.mask_offsets is not None:
        if tail.mask_ids is None or tail.mask_offsets is None:
            raise ValueError(f"{head.name()} has a sampling mask but its continuation has none")
        mask_ids = np.concatenate([head.mask_ids, tail.mask_ids])
        mask_offsets = np.concatenate(
            [head.mask_offsets, tail.mask_offsets[1:] + head.mask_offsets[-1]]
        )
    sampling_logprobs = None
    if head.sampling_logprobs is not None and tail.sampling_logprobs is not None:
        sampling_logprobs = np.concatenate([head.sampling_logprobs, tail.sampling_logprobs])
    versions = np.concatenate([head.versions, tail.versions])
    segments = list(head.meta.get("requests") or [_segment(head, 0)])
    segments.append(_segment(tail, R1))
    meta = {
        **head.meta,
        "requests": segments,
        "resumed": len(segments) - 1,
        "weight_versions": version_spans(versions),
        "completion_tokens": R1 + tail.response_len,
        "finish_reason": tail.meta.get("finish_reason"),
    }
    return Trajectory(
        prompt_ids=head.prompt_ids,
        response_ids=np.concatenate([head.response_ids, tail.response_ids]),
        response_logprobs=np.concatenate([head.response_logprobs, tail.response_logprobs]),
        versions=versions,
        sampling_logprobs=sampling_logprobs,
        routed_experts=routes,
        mask_ids=mask_ids,
        mask_offsets=mask_offsets,
        temperature=head.temperature,
        finish_reason=tail.finish_reason,
        reward=head.reward,
        group_id=head.group_id,
        index=head.index,
        meta=meta,
    )


async def continue_trajectory(
    client: EngineClient,
    head: Trajectory,
    sampling_params: Mapping[str, Any],
    *,
    routed_experts: bool,
    sampling_mask: bool,
    num_layers: int | None,
    topk: int | None,
    rid: str | None = None,
    lora_path: str | None = None,
) -> Trajectory:
    """Continue the aborted `head` (R1 >= 1 tokens) for the tokens it has left and return
    the spliced, validated trajectory (which may itself end in another abort)."""
    P, R1 = head.prompt_len, head.response_len
    remaining = int(sampling_params["max_new_tokens"]) - R1
    if remaining <= 0:  # aborted on its last token: nothing left to sample
        head.finish_reason = "length"
        return head
    prefix = np.concatenate([head.prompt_ids, head.response_ids])
    params = {**sampling_params, "max_new_tokens": remaining}
    response = await client.generate(
        prefix,
        params,
        return_logprob=True,
        return_routed_experts=routed_experts,
        routed_experts_start_len=P + R1 - 1 if routed_experts else None,
        return_sampling_mask=sampling_mask,
        sampling_logprobs_mode="selected" if sampling_mask else None,
        rid=rid,
        lora_path=lora_path,
    )
    if isinstance(response, list):
        raise EngineError("engine answered a single /generate with a list")
    url = response.get(ENGINE_URL_KEY)
    tail = trajectory_from_response(response, prefix, params, sampling_mask=sampling_mask, url=url)
    tail_routes = None
    if routed_experts:
        tail_routes = response_routes(
            response, rows=tail.response_len, num_layers=num_layers, topk=topk, url=url
        )
    return splice(head, tail, tail_routes).validate(num_layers=num_layers, topk=topk)


MAX_RESUMES = 64
"""Continuations of one completion before it counts as a failed request."""


def _decoding(
    routed_experts: bool, sampling_mask: bool, num_layers: int | None, topk: int | None
) -> dict[str, Any]:
    """What a completion records, as generate_trajectory's keyword arguments."""
    return {
        "routed_experts": routed_experts,
        "sampling_mask": sampling_mask,
        "num_layers": num_layers,
        "topk": topk,
    }


async def sample_completion(
    client: EngineClient,
    prompt_ids: Any,
    sampling_params: Mapping[str, Any],
    *,
    routed_experts: bool,
    sampling_mask: bool,
    num_layers: int | None,
    topk: int | None,
    group_id: int | str | None = None,
    index: int | None = None,
    rid: str | None = None,
    gate: asyncio.Event | None = None,
    on_resume: Callable[[], None] | None = None,
    lora_path: str | None = None,
) -> Trajectory:
    """One completion that survives aborts: each time it comes back with finish_reason
    abort it waits for `gate` (set while the engines generate) and continues from where it
    stopped (from scratch when nothing was sampled yet). Continuation rids are
    f"{rid}r{k}", so an abort of the prefix `rid` reaches them too."""
    kwargs = _decoding(routed_experts, sampling_mask, num_layers, topk)
    if gate is not None:
        await gate.wait()
    traj = await client.generate_trajectory(
        prompt_ids, sampling_params, group_id=group_id, index=index, rid=rid,
        lora_path=lora_path, **kwargs,
    )  # fmt: skip
    return await resume_aborted(
        client, traj, sampling_params, rid=rid, gate=gate, on_resume=on_resume,
        lora_path=lora_path, **kwargs,
    )  # fmt: skip


async def sample_group(
    client: EngineClient,
    prompt_ids: Any,
    sampling_params: Mapping[str, Any],
    n: int,
    *,
    routed_experts: bool,
    sampling_mask: bool,
    num_layers: int | None,
    topk: int | None,
    group_id: int | str | None = None,
    rid: str | None = None,
    gate: asyncio.Event | None = None,
    on_resume: Callable[[], None] | None = None,
    lora_path: str | None = None,
) -> list[Trajectory]:
    """n completions of one prompt as one /generate with sampling_params.n (the engine
    names them f"{rid}-n_{i}"); each aborted one is then continued on its own as
    sample_completion's, with continuation rids f"{rid}-{i}r{k}". An abort of the prefix
    f"{rid}-" reaches them all."""
    kwargs = _decoding(routed_experts, sampling_mask, num_layers, topk)
    if gate is not None:
        await gate.wait()
    trajs = await client.generate_group(
        prompt_ids, sampling_params, n, group_id=group_id,
        rid=None if rid is None else f"{rid}-n", lora_path=lora_path, **kwargs,
    )  # fmt: skip
    return list(
        await asyncio.gather(
            *(
                resume_aborted(
                    client,
                    traj,
                    sampling_params,
                    rid=None if rid is None else f"{rid}-{i}",
                    gate=gate,
                    on_resume=on_resume,
                    lora_path=lora_path,
                    **kwargs,
                )  # fmt: skip
                for i, traj in enumerate(trajs)
            )
        )
    )


async def resume_aborted(
    client: EngineClient,
    traj: Trajectory,
    sampling_params: Mapping[str, Any],
    *,
    routed_experts: bool,
    sampling_mask: bool,
    num_layers: int | None,
    topk: int | None,
    rid: str | None = None,
    gate: asyncio.Event | None = None,
    on_resume: Callable[[], None] | None = None,
    lora_path: str | None = None,
) -> Trajectory:
    """`traj` as it is, or, while it comes back with finish_reason abort, continued (or
    restarted when nothing was sampled) once `gate` opens, under rids f"{rid}r{k}"."""
    kwargs = _decoding(routed_experts, sampling_mask, num_layers, topk)
    resumes = 0
    while traj.finish_reason == "abort":
        if resumes == MAX_RESUMES:
            raise EngineError(f"{traj.name()} was aborted {resumes} times; giving up")
        resumes += 1
        if on_resume is not None:
            on_resume()
        if gate is not None:
            await gate.wait()
        sub_rid = None if rid is None else f"{rid}r{resumes}"
        if traj.response_len == 0:
            traj = await client.generate_trajectory(
                traj.prompt_ids, sampling_params, group_id=traj.group_id, index=traj.index,
                rid=sub_rid, lora_path=lora_path, **kwargs,
            )  # fmt: skip
        else:
            traj = await continue_trajectory(
                client, traj, sampling_params, rid=sub_rid, lora_path=lora_path, **kwargs
            )
    return traj


class UpdateGate:
    """What generation does around a weight update, per rollout.partial_rollout mode
    (moerl.rollout.orchestrator): `launch_open` is clear while no group may start,
    `engines_open` while no request may be sent (aborted completions wait on it)."""

    def __init__(
        self,
        client: EngineClient,
        mode: str,
        in_place_pause: bool | str,
        on_control_error: Callable[[], None] | None = None,
    ) -> None:
        self.client, self.mode, self.in_place_pause = client, mode, in_place_pause
        self.on_control_error = on_control_error
        self.launch_open = asyncio.Event()
        self.engines_open = asyncio.Event()
        self.held = False  # this update closed the gates instead of pausing the engines
        self.paused = False  # this update paused the engines in place
        self.open()

    def pauses_in_place(self, atomic: bool = False) -> bool:
        """in_place with in_place_pause: the engines pause around a push (unless quiet);
        with in_place_pause='auto' only around a push that is not ``atomic`` (one that
        every engine loads at once, between two of its decode steps: no token can see
        half-loaded weights, so generation goes on through it)."""
        if self.mode != "in_place" or self.in_place_pause is False:
            return False
        return self.in_place_pause is True or not atomic

    def open(self) -> None:
        self.launch_open.set()
        self.engines_open.set()

    async def before(
        self, wait_idle: Callable[[], Awaitable[None]], quiet: bool = False, atomic: bool = False
    ) -> None:
        """Before the push. wait_idle: returns once no group is generating (drain).
        ``quiet``: no request of this run is on the engines (the synchronous loop's every
        push); in_place then closes both gates instead of pausing the engines, which has
        nothing to hold (two HTTP round trips less per push). ``atomic``: see
        ``pauses_in_place``."""
        pauses = self.pauses_in_place(atomic)
        if pauses and quiet:
            self.launch_open.clear()
            self.engines_open.clear()
            self.held = True
        elif self.mode == "drain":
            self.launch_open.clear()
            await wait_idle()
        elif self.mode == "abort_resume":
            self.launch_open.clear()
            self.engines_open.clear()
            await self._control(self.client.pause_generation("abort"))
        elif pauses:
            self.paused = True
            await self._control(self.client.pause_generation("in_place"))

    async def after(self) -> None:
        """Every engine serves the new weights: requests and launches go on."""
        if self.held:
            self.held = False
        elif self.mode == "abort_resume" or self.paused:
            self.paused = False
            await self._control(self.client.continue_generation())
        self.open()

    async def _control(self, call: Coroutine[Any, Any, Any]) -> None:
        # A dead engine must not stop the trainer: it serves nothing, and requests that
        # reach it fail over. Count it and go on.
        try:
            await call
        except EngineError as err:
            if self.on_control_error is not None:
                self.on_control_error()
            log.warning("engine control call failed: %s", err)
