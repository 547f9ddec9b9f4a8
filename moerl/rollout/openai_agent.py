"""Roll out an agent written against the OpenAI client, unchanged (docs/architecture.md,
"Episodes").

    recorder = AgentRecorder(engine_url, num_layers=L, topk=K)
    reward = await my_agent(recorder.client, task)   # a real openai.AsyncOpenAI
    traj = recorder.episode(reward)                  # or recorder.trajectories()

``recorder.client`` is an ``openai.AsyncOpenAI`` on the engine's ``/v1`` routes (SGLang's
or the embedded engine's) whose HTTP transport adds SGLang's RL extension fields to every
``/v1/chat/completions`` request (``logprobs``, ``return_meta_info``,
``return_token_ids``, ``return_routed_experts``, ``return_sampling_mask``) and keeps each
answer. Each choice decodes into a Trajectory exactly as a ``/generate`` response does
(moerl.rollout.decode.response_from_openai_choice).

``episode()`` chains the calls into one episode trajectory when each call's prompt ids
start with the previous call's prompt and completion ids (token in, token out: send the
stream so far as SGLang's chat ``input_ids``): what lies between is spliced in as an
observation, and routes follow the first-forward rule of moerl.rollout.episode. A call
whose prompt re-renders the conversation differently (a chat template re-tokenising the
assistant's text) cannot be chained; ``episode()`` names it, and ``trajectories()`` still
gives one trajectory per call. Streaming calls are passed through unrecorded.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from moerl.common.trajectory import Trajectory
from moerl.engine.core.prefix_cache import shared_prefix
from moerl.rollout.decode import response_from_openai_choice, trajectory_from_response
from moerl.rollout.episode import RoleStream

RL_FIELDS = {
    "logprobs": True,
    "return_meta_info": True,
    "return_token_ids": True,
}


def _openai_httpx() -> Any:
    """The httpx the installed openai package is built on (``httpx`` up to openai 2,
    ``httpx2`` from openai 3), so the transport below fits its client."""
    import importlib

    import openai

    base = openai.DefaultAsyncHttpxClient.__mro__[1]
    return importlib.import_module(base.__module__.split(".")[0])


def _recording_client(recorder: AgentRecorder) -> Any:
    """openai's own async HTTP client, with a transport that adds the RL fields to chat
    requests and keeps the answers."""
    import openai

    hx = _openai_httpx()

    class Recording(hx.AsyncBaseTransport):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            self.inner = hx.AsyncHTTPTransport()

        async def handle_async_request(self, request: Any) -> Any:
            chat = request.method == "POST" and request.url.path.endswith("/chat/completions")
            body: dict[str, Any] = {}
            if chat:
                body = json.loads(await request.aread())
                chat = not body.get("stream")
            if chat:
                body.update(recorder.fields)
                headers = {
                    k: v for k, v in request.headers.items() if k.lower() != "content-length"
                }
                request = hx.Request(
                    request.method, request.url, headers=headers, json=body,
                    extensions=request.extensions,
                )  # fmt: skip
            response = await self.inner.handle_async_request(request)
            if not chat:
                return response
            content = await response.aread()
            if response.status_code == 200:
                recorder._keep(body, json.loads(content))
            return hx.Response(
                response.status_code, headers=response.headers, content=content,
                extensions=response.extensions,
            )  # fmt: skip

        async def aclose(self) -> None:
            await self.inner.aclose()

    return openai.DefaultAsyncHttpxClient(transport=Recording(), timeout=None)


class AgentRecorder:
    """An OpenAI client for one rollout of an agent, and the trajectories it sampled."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        routed_experts: bool = True,
        sampling_mask: bool = True,
        num_layers: int | None = None,
        topk: int | None = None,
    ) -> None:
        """base_url: the engine (``http://host:port``, without ``/v1``); routes need the
        model's num_layers and topk to be decoded."""
        import openai

        self.routed_experts, self.sampling_mask = routed_experts, sampling_mask
        self.num_layers, self.topk = num_layers, topk
        self.fields = {
            **RL_FIELDS,
            "return_routed_experts": routed_experts,
            "return_sampling_mask": sampling_mask,
        }
        self.calls: list[tuple[dict[str, Any], list[int], dict[str, Any]]] = []
        """(the /generate-shaped response, its prompt ids, its sampling params), in order."""
        self.client = openai.AsyncOpenAI(
            base_url=f"{base_url.rstrip('/')}/v1", api_key=api_key or "none",
            http_client=_recording_client(self),
        )  # fmt: skip

    def _keep(self, body: dict[str, Any], answer: dict[str, Any]) -> None:
        sampling = {"temperature": body.get("temperature", 1.0)}
        for choice in answer.get("choices") or []:
            response, prompt = response_from_openai_choice(choice)
            self.calls.append((response, prompt, sampling))

    def _trajectory(self, k: int) -> Trajectory:
        response, prompt, sampling = self.calls[k]
        return trajectory_from_response(
            response, prompt, sampling, routed_experts=self.routed_experts,
            sampling_mask=self.sampling_mask, num_layers=self.num_layers, topk=self.topk,
        )  # fmt: skip

    def trajectories(self, reward: float | None = None) -> list[Trajectory]:
        """One validated trajectory per recorded choice, each with ``reward``."""
        out = []
        for k in range(len(self.calls)):
            t = self._trajectory(k)
            t.reward, t.index = reward, k
            out.append(t.validate(num_layers=self.num_layers, topk=self.topk))
        return out

    def episode(self, reward: float) -> Trajectory:
        """The calls as one episode trajectory (module docstring), ``reward`` on its last
        action; ValueError naming the first call that does not extend the stream."""
        if not self.calls:
            raise ValueError("the agent made no chat completion call: nothing to train on")
        stream = RoleStream("policy")
        for k in range(len(self.calls)):
            turn = self._trajectory(k)
            prompt = turn.prompt_ids.tolist()
            if prompt[: len(stream.ids)] != stream.ids:
                at = shared_prefix(np.asarray(prompt), np.asarray(stream.ids))
                raise ValueError(
                    f"chat call {k} does not extend the previous calls' tokens (they differ "
                    f"from token {at} on): the conversation was rendered again and "
                    "re-tokenised. Send the stream so far as the chat request's input_ids "
                    "(token in, token out), or train on recorder.trajectories() instead"
                )
            stream.observe(prompt[len(stream.ids) :], "env", k - 1)
            routes = turn.routed_experts
            stream.commit(turn, None if routes is None else routes[stream.rows :], k)
        stream.reward(float(reward))
        return stream.trajectory().validate(num_layers=self.num_layers, topk=self.topk)

    async def aclose(self) -> None:
        await self.client.close()
