"""Every tensor the engine computes with follows its model's device (``--device``).

The same code paths run with the device passed explicitly: 'cpu' everywhere, 'cuda' on a
GPU machine (``pytest -m gpu``). KV pool, plan (indices, positions, mask), logits, the
engine's and a seeded request's generator, penalties, logit_bias, grammar masks, batched
draws, LoRA adapters (linear and per-expert) and received weights; routes leave as numpy.
"""

# V vocabulary, E experts, r rank

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_slots_for_tests import Owner

from moerl.engine.core.kv_pool import Plan
from moerl.engine.core.model_runner import ModelRunner
from moerl.engine.core.sampling import Sampler, SamplingParams, sample_batch
from moerl.engine.lora.adapters import LoraManager
from moerl.engine.weights.routes import ReceiveBuffers, receive_device

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NO_CUDA])]


class EvenTokens:
    """A grammar matcher (``moerl.engine.core.sampling.Matcher``) allowing even ids only; its
    mask is a CPU tensor, as the real backend's."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def allowed(self) -> torch.Tensor:
        return torch.arange(self.vocab) % 2 == 0

    def accept(self, token: int) -> None:
        assert token % 2 == 0

    @property
    def done(self) -> bool:
        return False


@pytest.fixture(scope="module", params=DEVICES)
def runner(request, tiny_checkpoints) -> ModelRunner:
    return ModelRunner(tiny_checkpoints["qwen3_moe"], device=request.param)


def same_device(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (tensor.device.index or 0) == (device.index or 0)


def test_model_pool_plan_and_logits_are_on_the_device(runner):
    dev = runner.device
    assert all(same_device(t, dev) for t in runner.model.parameters())
    assert all(same_device(t, dev) for t in runner.model.buffers())
    assert same_device(torch.empty(0, device=runner.generator.device), dev)
    pool = runner.new_pool(4)
    assert pool.device == dev
    owners = [Owner() for _ in range(2)]
    for o in owners:
        pool.alloc(o)
    logits, routes = runner.extend(pool, [o.slot for o in owners], [[5, 6, 7], [8, 9]])
    assert all(same_device(t, dev) for t in logits)
    assert all(isinstance(r, np.ndarray) and r.dtype == np.int32 for r in routes)
    assert routes[0].shape == (3, runner.num_layers, runner.topk)
    assert all(same_device(t, dev) for t in pool.keys + pool.values)
    logits_BV, routes_BLK = runner.decode(pool, [o.slot for o in owners], [10, 11])
    assert same_device(logits_BV, dev) and isinstance(routes_BLK, np.ndarray)
    plan = Plan([0, 1], [3, 2], [1, 1], dev)
    for t in (plan.rows, plan.cols, plan.slot_idx, plan.pos_idx, plan.index):
        assert same_device(t, dev)
    assert same_device(plan.positions(), dev)
    for boolean in (True, False):
        assert same_device(plan.attention_mask(runner.dtype, boolean), dev)
    keys, values = pool.export(owners[0].slot, 4)  # what the prefix cache keeps
    assert same_device(keys[0], dev) and same_device(values[0], dev)
    pool.load(owners[1].slot, keys, values)
    pool.free(owners[0], wipe=True)


def test_sampling_state_follows_the_generator(runner):
    dev, vocab = runner.device, runner.vocab_size
    logits_V = torch.randn(vocab, generator=torch.Generator().manual_seed(0)).to(dev)
    params = SamplingParams.from_request(
        {
            "temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.2,
            "frequency_penalty": 0.5, "min_new_tokens": 2, "logit_bias": {"4": 3.0},
            "sampling_seed": 7,
        },
        vocab,
    )  # fmt: skip
    drawn = []
    for _ in range(2):  # a seeded request draws the same tokens twice, on any device
        sampler = Sampler(params, vocab, runner.generator, [1], EvenTokens(vocab))
        assert sampler.generator.device == runner.generator.device
        assert sampler.bias is not None and same_device(sampler.bias, dev)
        drawn.append([sampler.sample(logits_V, 3, [2, 4]).token for _ in range(3)])
        assert sampler.counts is not None and same_device(sampler.counts, dev)
    assert drawn[0] == drawn[1] and all(t % 2 == 0 for t in drawn[0])
    logits_BV = logits_V.repeat(3, 1)
    for temperature in (0.0, 1.0):
        plain = SamplingParams.from_request({"temperature": temperature, "top_k": 50}, vocab)
        out = sample_batch(logits_BV, plain, runner.generator, [True, False, True])
        assert len(out) == 3 and out[0].mask and not out[1].mask
        assert all(0 <= s.token < vocab for s in out)


def test_lora_adapters_and_row_indices_are_on_the_device(runner):
    dev = runner.device
    lora = LoraManager(runner.model, max_rank=4)
    gen = torch.Generator().manual_seed(3)
    q = runner.model.model.layers[0].self_attn.q_proj
    tensors = {  # on the CPU, as safetensors load them
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(
            2, q.in_features, generator=gen
        ),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(
            q.out_features, 2, generator=gen
        ),
    }
    for name, module in lora.experts.items():
        experts, two_inter, hidden = module.gate_up_proj.shape  # [E, 2I, H]
        fan_in, fan_out = hidden, two_inter // 2
        for e in range(experts):
            prefix = f"base_model.model.{name}.{e}.gate_proj"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(2, fan_in, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, 2, generator=gen)
    config = {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj", "gate_proj"]}
    lora.load("a", config, tensors)
    adapter = lora.adapters["a"]
    assert all(same_device(t, dev) for pair in adapter.weights.values() for t in pair)
    stacked = [t for projs in adapter.experts.values() for pair in projs.values() for t in pair]
    assert stacked and all(same_device(t, dev) for t in stacked)
    runner.lora = lora
    try:
        pool = runner.new_pool(2)
        owners = [Owner() for _ in range(2)]
        for o in owners:
            pool.alloc(o)
        lora.set_rows(["a", None])
        assert same_device(lora.active["a"], dev)
        logits, _ = runner.extend(pool, [o.slot for o in owners], [[5, 6], [5, 6]], ["a", None])
        assert not torch.equal(logits[0], logits[1])  # the adapter changed its row only
    finally:
        runner.lora = None


def test_a_received_bucket_lands_in_the_model(runner):
    """``load_bucket`` (what both weight routes load with): CPU tensors, as a gloo bucket
    arrives, copied into the model on its device; twice, the second from cached targets."""
    dev = runner.device
    assert receive_device("gloo", dev) == torch.device("cpu")
    buffers = ReceiveBuffers(device=receive_device("gloo", dev))
    assert buffers.device == torch.device("cpu")
    names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    before = [runner.params[n].detach().clone() for n in names]
    try:
        for fill in (0.0, 2.0):
            values = [torch.full(b.shape, fill) for b in before]  # on the CPU
            assert runner.load_bucket(names, [v.shape for v in values], values) == 2
            for n in names:
                assert same_device(runner.params[n], dev)
                assert bool((runner.params[n] == fill).all())
    finally:
        runner.load_bucket(names, [b.shape for b in before], [b.cpu() for b in before])


def test_nccl_needs_a_gpu_engine():
    with pytest.raises(ValueError, match="nccl.*runs on cpu.*--device cuda"):
        receive_device("nccl", torch.device("cpu"))
