"""Model families: HF config translation, tensor maps, shipped model configs."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from moerl.convert.hf_io import CheckpointError, HFCheckpoint
from moerl.models import family_names, get_family
from moerl.models.maps import QKV, Concat
from moerl.models.tiny import model_config, tiny_config

TINY = ["deepseek_moe", "qwen3_moe"]
REAL = ["deepseek_v3", "deepseek_v2_lite", "moonlight_16b_a3b", "qwen3_30b_a3b", "qwen3_235b_a22b"]


@pytest.mark.parametrize("family", TINY)
def test_hf_config_roundtrip(family):
    model = tiny_config(family)
    again = get_family(family).from_hf(get_family(family).to_hf(model))
    # seq_length is a training setting, not part of an HF config
    assert asdict(again) | {"seq_length": 0} == asdict(model) | {"seq_length": 0}


def test_family_mismatch_is_named():
    qwen_cfg = get_family("qwen3_moe").to_hf(tiny_config("qwen3_moe"))
    with pytest.raises(ValueError, match="model_type='qwen3_moe'.*deepseek_moe"):
        get_family("deepseek_moe").from_hf(qwen_cfg)
    with pytest.raises(ValueError, match="model.family='llama'"):
        get_family("llama")


def test_deepseek_group_scores_must_agree_with_hf():
    cfg = get_family("deepseek_moe").to_hf(tiny_config("deepseek_moe"))
    cfg["num_experts_per_tok"] = (
        2  # 2 // topk_group 2 = 1: megatron-core would score groups by top-1
    )
    with pytest.raises(ValueError, match="must be 2"):
        get_family("deepseek_moe").from_hf(cfg)
    cfg["n_group"] = 1  # one group: routing is not group-limited, any top-k is fine
    assert get_family("deepseek_moe").from_hf(cfg).moe_router_num_groups is None


def test_qkv_layout_by_hand():
    # 4 heads in 2 groups, head_dim 1, hidden 1: rows are q0 q1 k0 v0 | q2 q3 k1 v1
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    conv = QKV(("q", "k", "v"), heads=4, groups=2, head_dim=1)
    fused = conv.to_megatron([q, k, v])
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = conv.to_hf(fused)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))


def test_concat_roundtrip():
    gate, up = torch.randn(3, 2), torch.randn(3, 2)
    conv = Concat(("g", "u"))
    fused = conv.to_megatron([gate, up])
    assert torch.equal(fused[:3], gate) and torch.equal(fused[3:], up)
    assert all(torch.equal(a, b) for a, b in zip(conv.to_hf(fused), [gate, up]))


@pytest.mark.parametrize("name", REAL + [f"{f}_tiny" for f in TINY])
def test_model_configs_build_megatron_configs(name):
    """Real-scale configs compose and give a valid megatron-core config (no weights)."""
    from moerl.config.parallel import ParallelConfig
    from moerl.models.gpt import build_transformer_config

    model = model_config(name)
    assert model.family in family_names()
    tp = min(8, model.num_query_groups or model.num_attention_heads) if model.num_layers > 8 else 1
    parallel = ParallelConfig(tp=tp, ep=min(model.num_experts, 8))
    parallel.validate(
        tp * 8,
        num_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        num_experts=model.num_experts,
    )
    tcfg = build_transformer_config(model, parallel, "bf16")
    assert tcfg.num_moe_experts == model.num_experts
    assert tcfg.multi_latent_attention == model.multi_latent_attention
    hf = (
        get_family(model.family).to_hf(model)
        if model.moe_router_enable_expert_bias or model.family == "qwen3_moe"
        else None
    )
    if hf is not None:
        assert get_family(model.family).from_hf(hf).num_layers == model.num_layers


def _write(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_truncated_safetensors_names_the_file(tmp_path):
    _write(tmp_path / "model.safetensors", {"a": torch.zeros(64)})
    (tmp_path / "config.json").write_text("{}")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated"):
        HFCheckpoint(tmp_path)


def test_missing_shard_names_the_file(tmp_path):
    _write(tmp_path / "model-00001-of-00002.safetensors", {"a": torch.zeros(2)})
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        HFCheckpoint(tmp_path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        HFCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        HFCheckpoint(tmp_path / "nope")


def test_slices_are_read_lazily(tmp_path):
    full = torch.arange(24.0).view(6, 4)
    _write(tmp_path / "model.safetensors", {"w": full})
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.shape("w") == (6, 4)
    assert torch.equal(ckpt.get_slice("w", (slice(2, 4), slice(0, 4))), full[2:4])
    with pytest.raises(CheckpointError, match="'x' is not in the checkpoint"):
        ckpt.get("x")


def test_tiny_tokenizer_roundtrip(tmp_path):
    from moerl.models.tokenizer import build_tiny_tokenizer, load_tokenizer

    build_tiny_tokenizer(128).save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    ids = tok("12+34=46").input_ids
    assert len(ids) == 8 and max(ids) < 128
    assert tok.decode(ids) == "12+34=46"
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path / "missing")


@pytest.mark.parametrize("family", TINY)
def test_tiny_checkpoint_special_ids_match_its_tokenizer(family, tiny_checkpoints):
    """config.json and generation_config.json stop where the tokenizer's <eos> is."""
    from moerl.models.tokenizer import load_tokenizer

    path = tiny_checkpoints[family]
    tok = load_tokenizer(path)
    ids = {"bos_token_id": "<bos>", "eos_token_id": "<eos>", "pad_token_id": "<pad>"}
    expected = {key: tok.convert_tokens_to_ids(text) for key, text in ids.items()}
    assert expected == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert expected == {key: getattr(tok, key) for key in ids}
    for name in ("config.json", "generation_config.json"):
        written = json.loads((path / name).read_text())
        assert {key: written.get(key) for key in ids} == expected, name
