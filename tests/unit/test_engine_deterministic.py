"""The engine's batch-invariant mode (``--enable-deterministic-inference``,
moerl/engine/core/invariant.py): a request's tokens, logprobs and routes have the same
bits alone and batched with 3 or 15 other requests, with its prompt from the prefix
cache, with its prefill chunked, and as one sample of a group reading a shared prompt;
for both families in fp32 and bf16, greedy and seeded sampling."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from engine_slots_for_tests import allocated
from test_engine_shared_prompt import _run

from moerl.engine.core.model_runner import ModelRunner
from moerl.engine.core.prefix_cache import PrefixCache
from moerl.engine.core.sampling import SamplingParams
from moerl.engine.core.scheduler import Request, Scheduler

rng = np.random.default_rng(0)
TARGET = rng.integers(3, 100, 11).tolist()
OTHERS = [rng.integers(3, 100, int(n)).tolist() for n in rng.integers(2, 30, 15)]


def _scenarios(runner: ModelRunner, new: int = 8) -> dict[str, Request]:
    """The target request's result in each scenario (the first is it alone)."""

    def run(batch, pick: int, **kw) -> Request:  # type: ignore[no-untyped-def]
        sched = Scheduler(
            runner, prefix_cache=PrefixCache(100_000), enable_routed_experts=True, **kw
        )
        return _run(sched, batch)[pick]

    target = (TARGET, new)
    return {
        "alone": run([[target]], 0),
        "beside 3": run([[target] + [(o, 6) for o in OTHERS[:3]]], 0),
        "beside 15": run(
            [[(o, 5) for o in OTHERS[:7]] + [target] + [(o, 9) for o in OTHERS[7:]]], 7
        ),
        "prompt cached": run([[(TARGET, 3)], [target]], 1),
        "chunked prefill": run([[target, (OTHERS[0], 4)]], 0, chunked_prefill_size=4),
        "shared prompt": run([[target] * 4], 2, shared_prompt_min_tokens=1),
    }


def _assert_same_bits(results: dict[str, Request]) -> None:
    alone = results["alone"]
    assert len(alone.output_ids) == 8
    for name, got in results.items():
        assert got.output_ids == alone.output_ids, name
        assert got.logprobs == alone.logprobs, name  # exact: the bits, not a tolerance
        np.testing.assert_array_equal(np.concatenate(got.routes), np.concatenate(alone.routes))
    assert results["prompt cached"].cached_tokens > 0
    assert results["shared prompt"].cached_tokens == len(TARGET)  # it read the leader's


@pytest.mark.parametrize("family", ["deepseek_moe", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_has_the_same_bits_in_every_batch(tiny_checkpoints, family, dtype):
    runner = ModelRunner(tiny_checkpoints[family], dtype=dtype, deterministic=True)
    assert runner.model.config._experts_implementation == "moerl_batch_invariant"
    assert runner.model.config._attn_implementation == "moerl_batch_invariant"
    _assert_same_bits(_scenarios(runner))


def test_seeded_sampling_draws_the_same_tokens_in_every_batch(tiny_checkpoints, monkeypatch):
    """A sampled request with its own ``sampling_seed`` draws the same tokens and reports
    the same logprobs whatever it is batched with (the others sample unseeded)."""
    import test_engine_shared_prompt as shared

    real = SamplingParams

    def seeded(**kw):  # type: ignore[no-untyped-def]
        kw.update(temperature=1.0, top_p=0.9, sampling_seed=1234)
        return real(**kw)

    monkeypatch.setattr(shared, "SamplingParams", seeded)
    runner = ModelRunner(tiny_checkpoints["qwen3_moe"], deterministic=True)
    _assert_same_bits(_scenarios(runner))


def test_the_served_engine_reports_the_mode_and_batches_invariantly(tiny_checkpoints):
    """Through the HTTP API: /server_info says so, and one prompt's output logprobs are the
    same sent alone and inside a batch of 8 prompts (SGLang's native /generate)."""
    from moerl.engine.inprocess import InProcessEngine, engine_mounts

    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def talk(engine: InProcessEngine) -> tuple[dict, dict, list[dict]]:
        async with httpx.AsyncClient(mounts=engine_mounts([engine]), timeout=60) as client:
            info = (await client.get(f"{engine.url}/server_info")).json()
            body = {"input_ids": TARGET, "sampling_params": sampling, "return_logprob": True}
            alone = (await client.post(f"{engine.url}/generate", json=body)).json()
            batch = {**body, "input_ids": [*OTHERS[:4], TARGET, *OTHERS[4:7]]}
            many = (await client.post(f"{engine.url}/generate", json=batch)).json()
            return info, alone, many

    engine = InProcessEngine(tiny_checkpoints["deepseek_moe"], "--enable-deterministic-inference")
    try:
        info, alone, many = asyncio.run(talk(engine))
    finally:
        engine.close()
    assert info["enable_deterministic_inference"] is True
    key = "output_token_logprobs"
    assert many[4]["output_ids"] == alone["output_ids"]
    assert many[4]["meta_info"][key] == alone["meta_info"][key]


def test_the_mode_is_refused_with_lora_before_anything_loads():
    from moerl.engine.cli import parse_args

    assert parse_args(["--model-path", "m"]).enable_deterministic_inference is False
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--enable-deterministic-inference", "--enable-lora"])


@pytest.mark.parametrize("family", ["deepseek_moe", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_router_twins_give_the_routers_bits_in_the_mode(tiny_checkpoints, family, dtype):
    """The mode runs DeepSeek-V3's and Qwen3-MoE's routers as twins that call the
    batch-invariant ops directly (moerl/engine/core/invariant.py): the same logits,
    weights and ids, bit for bit, as transformers' own router run inside
    ``BatchInvariant``, with a nonzero balancing bias and both normalisations."""
    import torch

    from moerl.engine.core import invariant
    from moerl.kernels import batch_invariant as bi

    runner = ModelRunner(tiny_checkpoints[family], dtype=dtype, deterministic=True)
    gate = next(iter(runner.routers.values()))
    twin = invariant._ROUTER_TWINS[type(gate).__name__]
    assert gate.forward.func is twin  # chosen at load: it passed the probe
    own = type(gate).forward.__get__(gate)  # transformers' forward, unpatched
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 37, gate.weight.shape[1], generator=gen).to(runner.dtype)
    if hasattr(gate, "e_score_correction_bias"):
        gate.e_score_correction_bias.copy_(torch.randn(gate.weight.shape[0], generator=gen))
    for norm in (True, False):
        gate.norm_topk_prob = norm
        with torch.no_grad():
            want = bi.invariant(own)(hidden)
            got = twin(gate, hidden)
        for a, b in zip(want, got, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), norm


def test_a_router_that_computes_otherwise_keeps_the_mode():
    """A router class of a twin's name whose forward differs (another transformers
    release) fails the probe and runs inside ``BatchInvariant`` instead."""
    import torch

    from moerl.engine.core import invariant

    class Qwen3MoeTopKRouter(torch.nn.Module):  # the name, not the computation
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 16))
            self.hidden_dim, self.top_k, self.norm_topk_prob = 16, 2, True

        def forward(self, hidden):  # type: ignore[no-untyped-def]
            logits = torch.nn.functional.linear(hidden.reshape(-1, 16), self.weight)
            top, ids = torch.topk(torch.sigmoid(logits), 2, dim=-1)  # sigmoid, not softmax
            return logits, top, ids

    assert invariant._router_twin(Qwen3MoeTopKRouter()) is None
    assert invariant._router_twin(torch.nn.Linear(4, 4)) is None  # no twin for the class


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_caches_expanded_keys_with_transformers_bits(tiny_checkpoints, dtype):
    """In the mode, DeepSeek's MLA caches each token's expanded keys and values
    (moerl/engine/core/invariant.py ``_mla_forward``): the pool holds heads × head dims
    per token, not the latent, and every scenario's tokens, logprobs and routes equal
    those of a runner whose attention is transformers' own forward (latent cache, every
    cached token expanded again at each step)."""
    import torch

    path = tiny_checkpoints["deepseek_moe"]
    runner = ModelRunner(path, dtype=dtype, deterministic=True)
    own = ModelRunner(path, dtype=dtype, deterministic=True)
    attention = [m for m in own.model.modules() if type(m).__name__ == "DeepseekV3Attention"]
    assert attention and all(m.forward.func.__name__ == "_mla_forward" for m in attention)
    for module in attention:
        module.forward = module.forward.args[1]  # transformers' forward, as loaded
    twin, reference = _scenarios(runner), _scenarios(own)
    for name, got in twin.items():
        want = reference[name]
        assert got.output_ids == want.output_ids, name
        assert got.logprobs == want.logprobs, name
        np.testing.assert_array_equal(np.concatenate(got.routes), np.concatenate(want.routes))
    module = attention[0]
    pools = []
    for each in (runner, own):
        pool = each.new_pool(2)
        each.extend(pool, [allocated(pool, 1)[0].slot], [TARGET])
        pools.append(pool)
    heads = module.num_heads
    assert pools[0].keys[0].shape[1:] == (heads, pools[0].capacity, module.qk_head_dim)
    assert pools[0].values[0].shape[1:] == (heads, pools[0].capacity, module.v_head_dim)
    assert pools[1].keys[0].shape[1] == 1  # transformers' latent
    assert pools[0].keys[0].dtype == getattr(torch, dtype)


def test_an_mla_forward_that_computes_otherwise_keeps_transformers_forward(tiny_checkpoints):
    """The expanded-cache twin replaces an attention's forward only where it gives that
    forward's bits on the probe: one that computes otherwise (another release), or
    another class, keeps its own."""
    import torch

    from moerl.engine.core import invariant

    runner = ModelRunner(tiny_checkpoints["deepseek_moe"], deterministic=True)
    module = next(m for m in runner.model.modules() if type(m).__name__ == "DeepseekV3Attention")
    rotary = runner.model.model.rotary_emb
    own = module.forward.args[1]
    module.forward = own
    assert invariant._mla_twin(module, rotary) is not None

    def other(*args, **kwargs):  # type: ignore[no-untyped-def]
        out, weights = own(*args, **kwargs)
        return out * 2, weights

    module.forward = other
    assert invariant._mla_twin(module, rotary) is None
    assert invariant._mla_twin(torch.nn.Linear(4, 4), rotary) is None


def test_the_mode_reads_the_pool_in_place_in_whole_key_tiles(tiny_checkpoints, monkeypatch):
    """In the mode every forward reads the KV pool up to whole tiles of ATTENTION_KEYS
    keys, and a decode step's attention takes the values as a view of the pool (no copy);
    a request's bits in every scenario are those of forwards that read only up to the
    longest row (whose keys the attention copies into zero-padded tiles)."""
    from moerl.engine.core.kv_pool import Plan
    from moerl.kernels import batch_invariant as bi

    runner = ModelRunner(tiny_checkpoints["deepseek_moe"], deterministic=True)
    seen: list[tuple[int, bool]] = []  # (keys, values read in place) per attention
    tiled = bi._tiled_attention

    def spy(q, k, v, index, counts, factor):  # type: ignore[no-untyped-def]
        if index is None:
            seen.append((k.shape[-2], not v.is_contiguous()))
        return tiled(q, k, v, index, counts, factor)

    monkeypatch.setattr(bi, "_tiled_attention", spy)
    in_place = _scenarios(runner)
    assert seen and all(n % bi.ATTENTION_KEYS == 0 for n, _ in seen)
    assert any(view for _, view in seen)
    monkeypatch.setattr(Plan, "read_whole_tiles", lambda self, tile, most: None)
    seen.clear()
    copied = _scenarios(runner)
    assert any(n % bi.ATTENTION_KEYS for n, _ in seen)  # the checks above can fail
    for name, got in in_place.items():
        assert got.output_ids == copied[name].output_ids, name
        assert got.logprobs == copied[name].logprobs, name
        np.testing.assert_array_equal(
            np.concatenate(got.routes), np.concatenate(copied[name].routes)
        )
