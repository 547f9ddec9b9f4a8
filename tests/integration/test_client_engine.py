"""Protocol conformance: moerl's client against the embedded engine over real HTTP."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moerl.parallel.spawn import free_port
from moerl.rollout import EngineClient
from moerl.rollout.errors import EngineError, RoutedExpertsMissing

SP = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 20, "top_p": 0.9}


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def server_info_when(client: EngineClient, url: str, ready, what: str) -> dict:  # type: ignore[no-untyped-def]
    """The engine's /server_info once ``ready(info)`` holds (polled, 30 s at most)."""
    for _ in range(3000):
        info = (await client.server_info())[url]
        if ready(info):
            return info
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine never showed {what}")


def test_trajectory_with_routes_and_mask(ds_engine):
    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            info = (await client.model_info())[ds_engine.url]
            traj = await client.generate_trajectory(
                [5, 6, 7, 8], SP, routed_experts=True, sampling_mask=True,
                num_layers=info["num_hidden_layers"], topk=info["num_experts_per_tok"],
                group_id=3, index=1,
            )  # fmt: skip
            raw = await client.generate(
                [5, 6, 7, 8], {**SP, "temperature": 0}, return_routed_experts=True
            )
            return info, traj, raw

    info, traj, raw = run(go())
    traj.validate(num_layers=4, topk=4, num_experts=8)
    r = len(traj.response_ids)
    assert traj.routed_experts.shape == (4 + r - 1, 4, 4)
    assert traj.mask_offsets.shape == (r + 1,) and traj.sampling_logprobs.shape == (r,)
    assert traj.temperature == 1.0 and traj.group_id == 3 and traj.index == 1
    assert np.all(traj.versions == int(info["weight_version"]))
    assert raw["meta_info"]["routed_experts"]  # base64 on the wire, decoded by the client


def test_missing_routes_is_an_error_not_a_silent_trajectory(tiny_checkpoints, engine_factory):
    eng = engine_factory(tiny_checkpoints["qwen3_moe"])  # no --enable-return-routed-experts

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([eng.url]) as client:
            await client.generate_trajectory([5, 6], SP, routed_experts=True, num_layers=4, topk=2)

    with pytest.raises(RoutedExpertsMissing, match="--enable-return-routed-experts"):
        run(go())


def test_control_calls(ds_engine):
    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            await client.health()
            await client.health_generate()
            server = (await client.server_info())[ds_engine.url]
            await client.flush_cache()
            await client.pause_generation("in_place")
            task = asyncio.create_task(
                client.generate([5, 6], {"max_new_tokens": 3, "temperature": 0})
            )
            url = ds_engine.url
            queued = await server_info_when(
                client, url, lambda i: i["waiting_requests"] == 1, "the request queued"
            )
            turns = queued["scheduler_loops"] + 3
            later = await server_info_when(
                client, url, lambda i: i["scheduler_loops"] >= turns, "three loop turns"
            )
            # requests wait while paused: the loop turned, nothing was admitted or stepped
            assert later["waiting_requests"] == 1 and later["running_requests"] == 0
            assert later["decode_steps"] == queued["decode_steps"] and not task.done()
            await client.continue_generation()
            out = await task
            await client.update_weight_version("11")
            out2 = await client.generate([5, 6], {"max_new_tokens": 2, "temperature": 0})
            await client.abort_request(abort_all=True)
            return server, out, out2

    server, out, out2 = run(go())
    assert server["enable_return_routed_experts"] is True
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out2["meta_info"]["weight_version"] == "11"


def test_weight_update_through_client_tags_tokens(tiny_checkpoints, engine_factory):
    """Trainer rank 0 in this process, the engine as rank 1; tokens after the swap carry
    the new version in the trajectory's per-token versions."""
    from moerl.engine.weights.bucket import dtype_name, flatten
    from moerl.engine.weights.group import broadcast, init_custom_process_group

    eng = engine_factory(tiny_checkpoints["deepseek_moe"], "--enable-return-routed-experts")
    with safe_open(str(tiny_checkpoints["deepseek_moe"] / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([eng.url]) as client:
            port = free_port()
            box: dict = {}
            joiner = threading.Thread(
                target=lambda: box.setdefault(
                    "g", init_custom_process_group("gloo", "127.0.0.1", port, 0, 2)
                )
            )
            joiner.start()
            await client.init_weights_update_group(
                "127.0.0.1", port, 1, 2, group_name="g1", backend="gloo"
            )
            joiner.join()
            long = asyncio.create_task(
                client.generate_trajectory(
                    [5, 6, 7],
                    {"max_new_tokens": 80, "temperature": 1.0, "ignore_eos": True},
                    routed_experts=True,
                    num_layers=4,
                    topk=4,
                )
            )
            running = await server_info_when(
                client, eng.url, lambda i: i["running_requests"] == 1, "the request running"
            )
            # a few tokens under version 0 before the swap
            steps = running["decode_steps"] + 3
            await server_info_when(
                client, eng.url, lambda i: i["decode_steps"] >= steps, "three decode steps"
            )
            await client.pause_generation("in_place")  # deterministic whatever the load
            await client.begin_weight_update()
            update = asyncio.create_task(
                client.update_weights_from_distributed(
                    list(tensors), [dtype_name(t.dtype) for t in tensors.values()],
                    [list(t.shape) for t in tensors.values()], group_name="g1",
                    flush_cache=False, weight_version="5", load_format="flattened_bucket",
                )
            )  # fmt: skip
            await asyncio.to_thread(broadcast, box["g"], flatten(list(tensors.values())))
            await update
            await client.end_weight_update()
            await client.continue_generation()
            traj = await long
            await client.destroy_weights_update_group("g1")
            return traj

    traj = run(go())
    assert traj.versions[0] == 0 and traj.versions[-1] == 5
    switch = int(np.argmax(traj.versions == 5))
    assert np.all(traj.versions[:switch] == 0) and np.all(traj.versions[switch:] == 5)
    traj.validate(num_layers=4, topk=4, num_experts=8)


def test_lora_from_tensors_through_client(tiny_checkpoints, engine_factory):
    eng = engine_factory(tiny_checkpoints["qwen3_moe"], "--enable-lora")
    a = torch.randn(4, 64)
    b = torch.randn(64, 4)
    tensors = {
        "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight": a,
        "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight": b,
    }

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([eng.url]) as client:
            await client.load_lora_adapter_from_tensors(
                "v1", tensors, {"r": 4, "lora_alpha": 8, "target_modules": ["o_proj"]}
            )
            with_lora = await client.generate(
                [5, 6, 7],
                {"max_new_tokens": 4, "temperature": 0},
                lora_path="v1",
                return_logprob=True,
            )
            without = await client.generate(
                [5, 6, 7], {"max_new_tokens": 4, "temperature": 0}, return_logprob=True
            )
            with pytest.raises(EngineError, match="already"):
                await client.load_lora_adapter_from_tensors(
                    "v1", tensors, {"r": 4, "lora_alpha": 8}
                )
            await client.unload_lora_adapter("v1")
            return with_lora, without

    with_lora, without = run(go())
    assert (
        with_lora["meta_info"]["output_token_logprobs"]
        != without["meta_info"]["output_token_logprobs"]
    )


def test_dead_engine_is_named_and_skipped(ds_engine):
    dead = f"http://127.0.0.1:{free_port()}"

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([dead], max_retries=1, retry_backoff_s=0.01) as client:
            with pytest.raises(EngineError) as err:
                await client.generate([5], {"max_new_tokens": 1})
            assert dead in str(err.value)
        async with EngineClient(
            [dead, ds_engine.url], max_retries=2, retry_backoff_s=0.01
        ) as client:
            outs = await asyncio.gather(
                *[
                    client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})
                    for _ in range(4)
                ]
            )
        return outs

    outs = run(go())
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
