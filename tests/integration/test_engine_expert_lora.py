"""Per-expert LoRA in the embedded engine, for both tiny MoE families.

The adapter covers attention, the dense MLP, shared experts and every routed expert of
every MoE layer. The reference is a second engine started from a checkpoint with the
adapter merged into the base weights (W + scaling · B A), LoRA off.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save, save_file

from moerl.rollout.client import EngineClient

RANK, ALPHA = 4, 8
MLP = ["gate_proj", "up_proj", "down_proj"]
ATTENTION = {
    "deepseek_moe": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21]]
NEW_TOKENS = 8
LAYERS = 4  # num_hidden_layers of both tiny configs (asserted in Setup)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.lora_")


def _body(prompt: list[int], lora: str | None = None, new_tokens: int = NEW_TOKENS) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    return body if lora is None else {**body, "lora_path": lora}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def _generate(url: str, bodies: list[dict]) -> list[dict]:
    """Concurrently, so the engine batches them."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: _post(url, "/generate", b), bodies))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def _same(a: dict, b: dict) -> None:
    """Same greedy tokens, logprobs within float32 rounding (merged W + BA and W·x + B(A·x)
    round differently: 1.07e-5 apart on a -3.27 logprob was seen), same routed-expert sets."""
    assert a["output_ids"] == b["output_ids"]
    la = [x for x, _, _ in a["meta_info"]["output_token_logprobs"]]
    lb = [x for x, _, _ in b["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
    routes = []
    for out in (a, b):
        raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), np.int32)
        rows = out["meta_info"]["prompt_tokens"] + out["meta_info"]["completion_tokens"] - 1
        routes.append(np.sort(raw.reshape(rows, LAYERS, -1), axis=-1))  # SGLang: unsorted top-k
    np.testing.assert_array_equal(*routes)


def _adapter(base: dict[str, torch.Tensor], targets: list[str]) -> dict[str, torch.Tensor]:
    """Random nonzero LoRA pairs on every 2-D weight whose module is a target."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    for key, w in sorted(base.items()):
        module = key.removesuffix(".weight")
        inside = "layers." in key or module == "lm_head"
        if w.dim() != 2 or module.rsplit(".", 1)[-1] not in targets or not inside:
            continue
        out[f"base_model.model.{module}.lora_A.weight"] = 0.2 * torch.randn(
            RANK, w.shape[1], generator=gen
        )
        out[f"base_model.model.{module}.lora_B.weight"] = 0.2 * torch.randn(
            w.shape[0], RANK, generator=gen
        )
    return out


def _merge(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict:
    merged = dict(base)
    for key, a in adapter.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = adapter[key.replace("lora_A", "lora_B")]
            merged[f"{module}.weight"] = base[f"{module}.weight"] + (ALPHA / RANK) * b @ a
    return merged


class Setup:
    """One family: the LoRA engine, the merged-weights engine, references."""

    def __init__(self, family, tiny_checkpoints, engine_factory, tmp) -> None:  # type: ignore[no-untyped-def]
        base_dir = tiny_checkpoints[family]
        base = load_file(str(base_dir / "model.safetensors"))
        self.targets = ATTENTION[family] + MLP
        self.config = {
            "r": RANK,
            "lora_alpha": ALPHA,
            "target_modules": self.targets,
            "peft_type": "LORA",
        }
        self.adapter = _adapter(base, self.targets)
        experts = [_EXPERT.search(k) for k in self.adapter]
        self.moe_layers = sorted({int(m.group(1)) for m in experts if m})
        self.num_experts = 1 + max(int(m.group(2)) for m in experts if m)
        assert self.moe_layers and self.num_experts == 8
        hf_config = json.loads((base_dir / "config.json").read_text())
        assert hf_config["num_hidden_layers"] == LAYERS
        self.vocab = hf_config["vocab_size"]
        self.adapter_dir = tmp / "adapter"
        self.adapter_dir.mkdir()
        save_file(self.adapter, str(self.adapter_dir / "adapter_model.safetensors"))
        (self.adapter_dir / "adapter_config.json").write_text(json.dumps(self.config))
        merged_dir = tmp / "merged"
        shutil.copytree(base_dir, merged_dir)
        save_file(_merge(base, self.adapter), str(merged_dir / "model.safetensors"))
        flags = ["--enable-return-routed-experts"]
        self.lora = engine_factory(
            base_dir,
            *flags,
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-target-modules",
            *self.targets,
        )
        self.merged = engine_factory(merged_dir, *flags)
        self.base_out = _generate(self.lora.url, [_body(p) for p in PROMPTS])  # nothing loaded
        self.merged_out = _generate(self.merged.url, [_body(p) for p in PROMPTS])
        result = asyncio.run(self._load_tensors("v1"))
        assert result[self.lora.url]["success"], result

    async def _load_tensors(self, name: str) -> dict:
        async with EngineClient([self.lora.url]) as client:
            return await client.load_lora_adapter_from_tensors(name, self.adapter, self.config)

    def load_raw(self, name: str, config: dict, tensors: dict) -> httpx.Response:
        payload = {
            "lora_name": name,
            "config_dict": config,
            "safetensors_b64": base64.b64encode(save(tensors)).decode(),
        }
        return _post(self.lora.url, "/load_lora_adapter_from_tensors", payload)

    def expert_key(self, layer: int, expert: int, proj: str, kind: str) -> str:
        return (
            f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.{proj}.lora_{kind}.weight"
        )


@pytest.fixture(scope="module", params=["deepseek_moe", "qwen3_moe"])
def setup(request, tiny_checkpoints, engine_factory, tmp_path_factory) -> Setup:
    tmp = tmp_path_factory.mktemp(f"expert-lora-{request.param}")
    return Setup(request.param, tiny_checkpoints, engine_factory, tmp)


def test_hot_swapped_adapter_equals_merged_weights(setup):
    outs = _generate(setup.lora.url, [_body(p, "v1") for p in PROMPTS])
    for out, ref, base in zip(outs, setup.merged_out, setup.base_out):
        _same(out, ref)
        assert (
            out["meta_info"]["output_token_logprobs"] != base["meta_info"]["output_token_logprobs"]
        )


def test_rows_without_adapter_equal_the_base_model(setup):
    bodies = [_body(p, "v1" if i % 2 else None) for i, p in enumerate(PROMPTS + PROMPTS)]
    outs = _generate(setup.lora.url, bodies)
    refs = setup.base_out + setup.base_out
    merged = setup.merged_out + setup.merged_out
    for i, (out, body) in enumerate(zip(outs, bodies)):
        _same(out, merged[i] if "lora_path" in body else refs[i])


def test_load_from_peft_directory(setup):
    r = _post(
        setup.lora.url,
        "/load_lora_adapter",
        {"lora_name": "dir-v1", "lora_path": str(setup.adapter_dir)},
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    outs = _generate(setup.lora.url, [_body(p, "dir-v1") for p in PROMPTS])
    for out, ref in zip(outs, setup.merged_out):
        _same(out, ref)
    assert _post(setup.lora.url, "/unload_lora_adapter", {"lora_name": "dir-v1"}).json()["success"]


def _drop(pattern: str):  # type: ignore[no-untyped-def]
    return lambda s, c, t: [t.pop(k) for k in [k for k in t if re.search(pattern, k)]]


def _truncate(tensors: dict, key: str) -> None:
    tensors[key] = tensors[key][:, :-1].contiguous()


BAD = {
    "collision": ("v1", None, ["'v1'", "already"]),
    "rank": ("big", lambda s, c, t: c.update(r=16), ["r=16", "--max-lora-rank"]),
    "target": (
        "lm",
        lambda s, c, t: c.update(target_modules=s.targets + ["lm_head"]),
        ["lm_head", "--lora-target-modules"],
    ),
    "expert-out-of-range": (
        "oob",
        lambda s, c, t: t.update(
            {
                s.expert_key(s.moe_layers[0], 8, "up_proj", "A"): torch.zeros(RANK, 64),
                s.expert_key(s.moe_layers[0], 8, "up_proj", "B"): torch.zeros(32, RANK),
            }
        ),
        ["expert index 8", "out of range", "0..7"],
    ),
    "missing-expert": (
        "missing",
        _drop(r"layers\.\d+\.mlp\.experts\.3\.up_proj"),
        ["missing", "[3]", "up_proj", "every expert"],
    ),
    "missing-layer": (
        "missing-layer",
        _drop(r"layers\.2\.mlp\.experts\.\d+\.down_proj"),
        ["missing", "down_proj", "layers.2.mlp.experts"],
    ),
    "dense-layer": (
        "dense",
        lambda s, c, t: t.update(
            {
                s.expert_key(0, 0, "gate_proj", "A"): torch.zeros(RANK, 64),
                s.expert_key(0, 0, "gate_proj", "B"): torch.zeros(32, RANK),
            }
        ),
        ["layer 0", "no routed experts"],
    ),
    "expert-shape": (
        "shape",
        lambda s, c, t: _truncate(t, s.expert_key(s.moe_layers[-1], 2, "down_proj", "A")),
        ["experts.2.down_proj", "do not fit"],
    ),
    "expert-half-pair": (
        "half",
        _drop(r"layers\.\d+\.mlp\.experts\.1\.gate_proj\.lora_B"),
        ["experts.1.gate_proj", "needs both lora_A and lora_B"],
    ),
    "untargeted-tensor": (
        "head",
        lambda s, c, t: (
            c.pop("target_modules"),
            t.update(
                {
                    "base_model.model.lm_head.lora_A.weight": torch.zeros(RANK, 64),
                    "base_model.model.lm_head.lora_B.weight": torch.zeros(s.vocab, RANK),
                }
            ),
        ),
        ["lm_head", "--lora-target-modules"],
    ),
    "dora": ("dora", lambda s, c, t: c.update(use_dora=True), ["DoRA"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapters_are_refused_whole(setup, case):
    name, edit, words = BAD[case]
    config, tensors = dict(setup.config), dict(setup.adapter)
    if edit is not None:
        edit(setup, config, tensors)
    r = setup.load_raw(name, config, tensors)
    body = r.json()
    assert r.status_code == 400 and body["success"] is False, body
    for word in words:
        assert word in body["error_message"], body["error_message"]
    assert sorted(body["loaded_adapters"]) == ["v1"]
    # still serving, unchanged: the adapter that was loaded and the base model
    _same(_generate(setup.lora.url, [_body(PROMPTS[0], "v1")])[0], setup.merged_out[0])
    _same(_generate(setup.lora.url, [_body(PROMPTS[0])])[0], setup.base_out[0])


def test_versioned_names_leave_waiting_requests_on_their_adapter(setup):
    url = setup.lora.url
    assert setup.load_raw("policy-v2", setup.config, setup.adapter).json()["success"]
    assert _post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(_generate(url, [_body(PROMPTS[1], "policy-v2")])[0])
    )
    thread.start()
    deadline = time.time() + 30
    while httpx.get(f"{url}/server_info").json()["waiting_requests"] < 1:
        assert time.time() < deadline
        time.sleep(0.02)
    other = {k: (-v if ".lora_B." in k else v) for k, v in setup.adapter.items()}
    assert setup.load_raw("policy-v3", setup.config, other).json()["success"]
    busy = _post(url, "/unload_lora_adapter", {"lora_name": "policy-v2"})
    assert busy.status_code == 400 and "used by 1" in busy.json()["error_message"]
    assert _post(url, "/continue_generation", {}).status_code == 200
    thread.join(60)
    _same(result, setup.merged_out[1])  # finished on policy-v2, untouched by policy-v3
    v3 = _generate(url, [_body(PROMPTS[1], "policy-v3")])[0]
    assert v3["meta_info"]["output_token_logprobs"] != result["meta_info"]["output_token_logprobs"]
    for name in ("policy-v2", "policy-v3"):
        assert _post(url, "/unload_lora_adapter", {"lora_name": name}).json()["success"]
    gone = _post(url, "/generate", _body(PROMPTS[1], "policy-v2"))
    assert gone.status_code == 400 and "policy-v2" in gone.text


@pytest.mark.parametrize("transport", ["tensors", "directory"])
def test_adapter_sync_versions_by_either_transport(setup, tmp_path, transport):
    """AdapterSync (the trainer side): each push loads `sync-vN` by its transport, the
    previous version is unloaded (and its directory removed), the engine serves the
    pushed adapter exactly, and a restarted engine gets the current one back."""
    from moerl.rollout.aio import EventLoopThread
    from moerl.sync.adapters import AdapterSync
    from moerl.sync.publish import Adapters

    url = setup.lora.url
    loop = EventLoopThread("test-adapter-sync")
    client = EngineClient([url])
    seen: list[tuple[str, int]] = []
    try:
        sync = AdapterSync(
            lambda: setup.adapter, setup.config, client=client, run_coro=loop.submit,
            prefix="sync", transport=transport, directory=tmp_path / "adapters",
        )  # fmt: skip
        publisher = Adapters(sync)
        for version in (1, 2):
            pub = publisher.push(version)
            seen.append((pub.adapter, pub.version))
            assert pub.stats["bytes"] == sum(
                t.numel() * t.element_size() for t in setup.adapter.values()
            )
        assert seen == [("sync-v1", 1), ("sync-v2", 2)] and sync.loaded == ["sync-v2"]
        _same(_generate(url, [_body(PROMPTS[0], "sync-v2")])[0], setup.merged_out[0])
        gone = _post(url, "/generate", _body(PROMPTS[0], "sync-v1"))
        assert gone.status_code == 400
        if transport == "directory":
            assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["sync-v2"]
        # an engine that lost its adapters (a restart) gets the current one back
        assert _post(url, "/unload_lora_adapter", {"lora_name": "sync-v2"}).json()["success"]
        assert loop.run(publisher.restore(url), 60)  # ready at once: no group to rejoin
        _same(_generate(url, [_body(PROMPTS[0], "sync-v2")])[0], setup.merged_out[0])
        assert _post(url, "/unload_lora_adapter", {"lora_name": "sync-v2"}).json()["success"]
    finally:
        loop.run(client.aclose(), 60)
        loop.stop()


def test_truncated_adapter_directory_is_refused(setup, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(setup.adapter_dir, bad)
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    r = _post(setup.lora.url, "/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "cannot read the adapter" in r.json()["error_message"]
    assert "bad" not in r.json()["loaded_adapters"]


def test_output_layer_adapter_equals_merged_weights(tiny_checkpoints, engine_factory, tmp_path):
    """An adapter on lm_head (with the decoder's linears): the engine's hot-swapped
    adapter equals the merged weights, for batched rows with and without it."""
    base_dir = tiny_checkpoints["qwen3_moe"]
    base = load_file(str(base_dir / "model.safetensors"))
    targets = ATTENTION["qwen3_moe"] + MLP + ["lm_head"]
    adapter = _adapter(base, targets)
    assert "base_model.model.lm_head.lora_B.weight" in adapter
    config = {"r": RANK, "lora_alpha": ALPHA, "target_modules": targets, "peft_type": "LORA"}
    merged_dir = tmp_path / "merged"
    shutil.copytree(base_dir, merged_dir)
    save_file(_merge(base, adapter), str(merged_dir / "model.safetensors"))
    flags = ["--enable-return-routed-experts"]
    lora = engine_factory(base_dir, *flags, "--enable-lora", "--max-lora-rank", "8",
                          "--lora-target-modules", *targets)  # fmt: skip
    merged = engine_factory(merged_dir, *flags)
    payload = {
        "lora_name": "head",
        "config_dict": config,
        "safetensors_b64": base64.b64encode(save(adapter)).decode(),
    }
    assert _post(lora.url, "/load_lora_adapter_from_tensors", payload).json()["success"]
    bodies = [_body(p, "head" if i % 2 == 0 else None) for i, p in enumerate(PROMPTS)]
    outs = _generate(lora.url, bodies)
    refs = _generate(merged.url, [_body(p) for p in PROMPTS])
    plain = _generate(lora.url, [_body(p) for p in PROMPTS])
    for i, out in enumerate(outs):
        _same(out, refs[i] if i % 2 == 0 else plain[i])
