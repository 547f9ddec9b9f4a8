"""An agent written against the `openai` package, rolled out unchanged through
moerl.rollout.openai_agent.AgentRecorder on the embedded engine: its calls become a
multi-turn episode with the engine's own token ids, routes and sampling masks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moerl.engine.core.prefix_cache import shared_prefix
from moerl.models.tokenizer import build_tiny_tokenizer
from moerl.rollout import EngineClient
from moerl.rollout.openai_agent import AgentRecorder

pytest.importorskip("openai")
L, K = 4, 4  # the tiny DeepSeek model


async def token_agent(client, tok) -> float:  # type: ignore[no-untyped-def]
    """Two turns, token in / token out: the second request's input_ids are the first
    call's prompt and completion ids and a tool result's tokens."""
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": "12+7="}]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    choice = first.choices[0].model_extra
    stream = choice["prompt_token_ids"] + choice["response_token_ids"]
    stream += tok(" tool: 19 assistant: ", add_special_tokens=False)["input_ids"]
    second = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, extra_body={"input_ids": stream}
    )
    return 1.0 if "19" in (second.choices[0].message.content or "") else 0.25


async def text_agent(client) -> float:  # type: ignore[no-untyped-def]
    """Two turns by messages: the second call renders the conversation again."""
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": "12+7="}]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "again"},
    ]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    return 0.0


def test_a_token_in_token_out_agent_becomes_one_episode(ds_engine):
    tok = build_tiny_tokenizer()

    async def go():  # type: ignore[no-untyped-def]
        recorder = AgentRecorder(ds_engine.url, num_layers=L, topk=K)
        reward = await token_agent(recorder.client, tok)
        await recorder.aclose()
        async with EngineClient([ds_engine.url]) as client:  # the same stream by /generate
            _, prompt, _ = recorder.calls[1]
            ref = await client.generate_trajectory(
                prompt, {"max_new_tokens": 1, "temperature": 0}, routed_experts=True,
                num_layers=L, topk=K,
            )  # fmt: skip
        return recorder, reward, ref

    recorder, reward, ref = asyncio.run(go())
    ep = recorder.episode(reward)
    (r1, p1, _), (r2, p2, _) = recorder.calls
    assert ep.prompt_ids.tolist() == p1
    assert ep.prompt_ids.tolist() + ep.response_ids.tolist() == p2 + r2["output_ids"]
    sources = [s.source for s in ep.segments]
    assert sources == ["policy", "env", "policy"]
    assert ep.reward == reward and ep.segments[-1].reward == reward
    assert ep.loss_mask.sum() == len(r1["output_ids"]) + len(r2["output_ids"])
    # every routed row up to the second prompt's end is the engine's, in order
    n = len(p2) - 1
    np.testing.assert_array_equal(ep.routed_experts[:n], ref.routed_experts[:n])
    assert ep.has_sampling_mask
    lp = [e[0] for e in r2["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(ep.response_logprobs[ep.segments[-1].start :], lp)


def test_a_re_rendering_agent_is_named_and_still_gives_trajectories(ds_engine):
    async def go():  # type: ignore[no-untyped-def]
        recorder = AgentRecorder(ds_engine.url, num_layers=L, topk=K)
        reward = await text_agent(recorder.client)
        await recorder.aclose()
        return recorder, reward

    recorder, reward = asyncio.run(go())
    (r1, p1, _), (_, p2, _) = recorder.calls
    if p2[: len(p1) + len(r1["output_ids"])] == p1 + r1["output_ids"]:
        pytest.skip("this sample re-rendered to the same tokens")  # EOS is re-rendered apart
    with pytest.raises(ValueError, match="chat call 1 does not extend .* input_ids"):
        recorder.episode(reward)
    trajs = recorder.trajectories(reward)
    assert [t.prompt_ids.tolist() for t in trajs] == [p1, p2]
    assert all(t.routed_experts is not None and t.has_sampling_mask for t in trajs)


def test_shared_prefix_names_where_a_call_diverges():
    assert shared_prefix(np.array([1, 2, 3]), np.array([1, 2, 4])) == 2
    assert shared_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert shared_prefix(np.array([5]), np.array([6])) == 0
