"""The embedded engine's correctness bars, against independent references.

References are plain transformers forwards of the same checkpoint with hooks and
sampling-set code written here, not moerl's engine code.
"""

from __future__ import annotations

import base64
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from engine_http import WeightTrainer, checkpoint_tensors
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21], [30, 31, 32, 33, 34]]


def _post(url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=timeout)


def _generate_many(url: str, bodies: list[dict]) -> list[dict]:
    """Send concurrently, so the engine batches them."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: _post(url, "/generate", b), bodies))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


class Reference:
    """transformers' model of a checkpoint, full forward, routes by hooks on mlp.gate."""

    def __init__(self, path) -> None:  # type: ignore[no-untyped-def]
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        cfg = self.model.config
        self.layers, self.topk = cfg.num_hidden_layers, cfg.num_experts_per_tok
        self.captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and not isinstance(gate, torch.nn.Linear):
                gate.register_forward_hook(
                    lambda m, a, out, i=i: self.captured.__setitem__(i, out[2])
                )

    @torch.no_grad()
    def run(self, tokens: list[int]) -> tuple[torch.Tensor, np.ndarray]:
        self.captured.clear()
        logits = self.model(torch.tensor([tokens])).logits[0].float()
        routes = np.zeros((len(tokens), self.layers, self.topk), np.int32)
        for i, ids in self.captured.items():
            routes[:, i] = ids.numpy()
        return logits, routes


@pytest.fixture(scope="module")
def reference(tiny_checkpoints) -> Reference:
    return Reference(tiny_checkpoints["deepseek_moe"])


def _routes(meta: dict, layers: int, topk: int) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    return raw.reshape(-1, layers, topk)


def test_routing_capture_equals_full_forward(ds_engine, reference):
    bodies = [
        {
            "input_ids": p,
            "sampling_params": {"max_new_tokens": 6 + i, "temperature": 1.0},
            "return_routed_experts": True,
        }
        for i, p in enumerate(PROMPTS)
    ]
    for prompt, out in zip(PROMPTS, _generate_many(ds_engine.url, bodies)):
        tokens = prompt + out["output_ids"]
        got = _routes(out["meta_info"], reference.layers, reference.topk)
        assert got.shape[0] == len(tokens) - 1  # SGLang rows: the last token has none
        _, want = reference.run(tokens[:-1])
        assert not want[:, 0].any() and not got[:, 0].any()  # layer 0 is dense: zeros
        for t in range(got.shape[0]):
            for layer in range(1, reference.layers):
                assert set(got[t, layer]) == set(want[t, layer]), (t, layer)


def test_routed_experts_start_len(ds_engine, reference):
    prompt = PROMPTS[2]
    full, part = _generate_many(
        ds_engine.url,
        [
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "return_routed_experts": True,
                **extra,
            }
            for extra in ({}, {"routed_experts_start_len": 3})
        ],
    )
    a = _routes(full["meta_info"], reference.layers, reference.topk)
    b = _routes(part["meta_info"], reference.layers, reference.topk)
    assert np.array_equal(a[3:], b)


def _reference_kept(
    logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float
) -> list[int]:
    """The sampling support, written independently: ids ordered by probability."""
    probs = torch.softmax(logits / t, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True).tolist()
    kept, mass = [], 0.0
    top = probs[order[0]].item()
    for rank, tok in enumerate(order):
        p = probs[tok].item()
        if top_k > 0 and rank >= top_k:
            break
        if kept and mass >= top_p:
            break
        if p < min_p * top:
            break
        kept.append(tok)
        mass += p
    return kept


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.0},
        {"temperature": 1.3, "top_k": -1, "top_p": 0.5, "min_p": 0.0},
        {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.3},
    ],
)
def test_sampling_mask_matches_recomputation(ds_engine, reference, params):
    bodies = [
        {
            "input_ids": p,
            "sampling_params": {"max_new_tokens": 5, **params},
            "return_logprob": True,
            "return_sampling_mask": True,
        }
        for p in PROMPTS[:3]
    ]
    for prompt, out in zip(PROMPTS, _generate_many(ds_engine.url, bodies)):
        meta = out["meta_info"]
        tokens = prompt + out["output_ids"]
        logits, _ = reference.run(tokens[:-1])
        for j, tok in enumerate(out["output_ids"]):
            row = logits[len(prompt) - 1 + j]
            kept = _reference_kept(
                row, params["temperature"], params["top_k"], params["top_p"], params["min_p"]
            )
            mask = meta["output_token_sampling_mask"][j]
            assert set(mask) == set(kept) and tok in mask
            logp = torch.log_softmax(row / params["temperature"], dim=-1)
            assert meta["output_token_logprobs"][j][1] == tok
            assert meta["output_token_logprobs"][j][0] == pytest.approx(logp[tok].item(), abs=1e-4)
            renorm = logp[tok] - torch.logsumexp(logp[mask], dim=0)
            assert meta["output_token_sampling_logprobs"][j] == pytest.approx(
                renorm.item(), abs=1e-4
            )


def test_greedy_mask_is_one_token(ds_engine, reference):
    out = _generate_many(
        ds_engine.url,
        [
            {
                "input_ids": PROMPTS[0],
                "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                "return_sampling_mask": True,
                "return_logprob": True,
            }
        ],
    )[0]
    tokens = PROMPTS[0] + out["output_ids"]
    logits, _ = reference.run(tokens[:-1])
    for j, tok in enumerate(out["output_ids"]):
        assert out["meta_info"]["output_token_sampling_mask"][j] == [tok]
        assert out["meta_info"]["output_token_sampling_logprobs"][j] == 0.0
        assert tok == int(logits[len(PROMPTS[0]) - 1 + j].argmax())


# --- weight updates -----------------------------------------------------------------


@pytest.fixture(scope="module")
def updated_pair(tiny_checkpoints, engine_factory, tmp_path_factory):
    """An engine started on checkpoint A, and checkpoint B (same shape, new weights)."""
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    b = save_tiny_checkpoint(
        tiny_config("deepseek_moe"), tmp_path_factory.mktemp("b") / "hf", seed=1
    )
    engine = engine_factory(tiny_checkpoints["deepseek_moe"], "--enable-return-routed-experts")
    return engine, WeightTrainer(engine.url), b


def test_weight_update_matches_fresh_engine(updated_pair, engine_factory):
    engine, trainer, b = updated_pair
    result = trainer.send(checkpoint_tensors(b), version="1", bucketed=True)
    assert result["success"], result
    fresh = engine_factory(b)
    body = {
        "input_ids": PROMPTS[2],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "return_logprob": True,
    }
    got = _post(engine.url, "/generate", body).json()
    want = _post(fresh.url, "/generate", body).json()
    assert got["output_ids"] == want["output_ids"]
    for (lp_a, tok_a, _), (lp_b, tok_b, _) in zip(
        got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]
    ):
        assert tok_a == tok_b and abs(lp_a - lp_b) < 1e-5
    assert got["meta_info"]["weight_version"] == "1"


def test_weight_update_mid_generation_gives_version_spans(updated_pair, tiny_checkpoints):
    engine, trainer, _ = updated_pair
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 100, "temperature": 1.0, "ignore_eos": True},
    }
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _post(engine.url, "/generate", body)))
    t.start()
    # wait until the request is decoding, then swap weights under it (per-tensor broadcast)
    for _ in range(200):
        info = httpx.get(f"{engine.url}/server_info").json()
        if info["running_requests"]:
            break
        threading.Event().wait(0.01)
    # Pause in place so the swap lands mid-request whatever the machine's load (the
    # never-stop path without a pause is measured by tools/bench/engine.py).
    _post(engine.url, "/pause_generation", {"mode": "in_place"})
    a = checkpoint_tensors(tiny_checkpoints["deepseek_moe"])
    result = trainer.send(a, version="2", bucketed=False)
    assert result["success"], result
    _post(engine.url, "/continue_generation", {})
    t.join()
    meta = box["r"].json()["meta_info"]
    spans = meta["weight_versions"]
    assert len(spans) >= 2 and spans[-1]["version"] == "2", spans
    assert spans[0]["start"] == 0 and spans[-1]["end"] == meta["completion_tokens"] == 100
    assert all(x["end"] == y["start"] for x, y in zip(spans, spans[1:]))


def test_bad_weight_update_leaves_model_untouched(updated_pair):
    engine, trainer, _ = updated_pair
    body = {
        "input_ids": PROMPTS[1],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "return_logprob": True,
    }
    before = _post(engine.url, "/generate", body).json()
    bad = {
        "model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(3, 3),
        "model.nope.weight": torch.zeros(2),
    }
    result = trainer.send(bad, version="9", bucketed=True)
    assert not result["success"] and "model unchanged" in result["message"]
    after = _post(engine.url, "/generate", body).json()
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
