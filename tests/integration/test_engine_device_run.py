"""The engine's ``--device``: 'cpu' and 'auto' (the default) serve the same outputs on a
CPU machine, 'cuda' without CUDA fails at start-up naming the flag and the fix, and on a
GPU machine (``pytest -m gpu``) a CUDA engine's greedy tokens and routes equal
transformers' own ``generate`` and forward on CUDA."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from moerl.engine.process import EngineProcess

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


def _generate(url: str, body: dict) -> dict:
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _routes(meta: dict, layers: int, topk: int) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    return raw.reshape(-1, layers, topk)


def _outputs(url: str) -> list[tuple[list[int], list[float], str]]:
    """Greedy and seeded-sampled outputs (tokens, logprobs, routes) of every prompt."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        for params in (
            {"temperature": 0.0},
            {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 11 + i},
            {"temperature": 1.0, "repetition_penalty": 1.3, "sampling_seed": 3},
        ):
            got = _generate(url, {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, **params},
                "return_logprob": True, "return_routed_experts": True,
            })  # fmt: skip
            meta = got["meta_info"]
            logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
            out.append((got["output_ids"], logprobs, meta["routed_experts"]))
    return out


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
@pytest.mark.skipif(torch.cuda.is_available(), reason="auto means cuda on this machine")
def test_cpu_and_auto_serve_the_same_outputs(tiny_checkpoints, engine_factory):
    # two fresh engines: the session's shared one may hold other tests' weights and cache
    path = tiny_checkpoints["deepseek_moe"]
    cpu = engine_factory(path, "--device", "cpu", "--enable-return-routed-experts")
    auto = engine_factory(path, "--enable-return-routed-experts")  # no --device: auto
    for url in (cpu.url, auto.url):
        assert httpx.get(f"{url}/server_info", timeout=30).json()["device"] == "cpu"
    assert _outputs(cpu.url) == _outputs(auto.url)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_fails_at_start_naming_the_flag_and_the_fix(tiny_checkpoints, tmp_path):
    with pytest.raises(RuntimeError, match=r"--device cuda: .*no CUDA device.*--device cpu"):
        EngineProcess(
            tiny_checkpoints["qwen3_moe"],
            "--device",
            "cuda",
            threads=1,
            log_path=tmp_path / "engine.log",
            startup_timeout_s=60,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_greedy_equals_generate_with_routes(tiny_checkpoints, engine_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["deepseek_moe"]
    eng = engine_factory(path, "--device", "cuda", "--enable-return-routed-experts")
    info = httpx.get(f"{eng.url}/server_info", timeout=30).json()
    assert info["device"] == "cuda"
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval().to("cuda")
    layers, topk = hf.config.num_hidden_layers, hf.config.num_experts_per_tok
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(hf.model.layers):  # transformers' router output: (.., ids)
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and not isinstance(gate, torch.nn.Linear):
            gate.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[2]))
    for prompt in PROMPTS:
        got = _generate(eng.url, {
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "return_routed_experts": True,
        })  # fmt: skip
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12
            )[0, len(prompt) :].tolist()
        assert got["output_ids"] == ref, (prompt, got["output_ids"], ref)
        # routes of every token the engine ran (all but the last sampled one)
        tokens = prompt + got["output_ids"][:-1]
        captured.clear()
        with torch.no_grad():
            hf(torch.tensor([tokens], device="cuda"))
        want = np.zeros((len(tokens), layers, topk), np.int32)
        for i, routed in captured.items():
            want[:, i] = routed.cpu().numpy()
        np.testing.assert_array_equal(_routes(got["meta_info"], layers, topk), want)
