"""Model families as plug-ins: a family from test code (tests/families_for_tests.py, no
moerl edits) is found by name, by import path and by model_type; every consumer's lookup
goes through the one registry (moerl.checks.replay reads DeepSeek-V2 checkpoints too)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

import pytest
import torch
from families_for_tests import PATH, TOY_MOE
from hydra import compose, initialize_config_module

from moerl.config.store import register_configs
from moerl.models import ModelFamily, family_for_model_type, family_names, get_family
from moerl.models.tiny import tiny_config
from moerl.validate import validate_config


def test_user_family_by_name_and_by_import_path():
    assert get_family("toy_moe") is TOY_MOE
    assert "toy_moe" in family_names()
    by_path = get_family(PATH)
    assert by_path.name == PATH  # so a ModelConfig names it in every process
    assert dataclasses.replace(by_path, name="toy_moe") == TOY_MOE
    assert get_family(PATH) is by_path  # imported once, then registered
    assert tiny_config(PATH).family == PATH
    assert tiny_config("toy_moe").family == "toy_moe"


@pytest.mark.parametrize(
    "model_type, family",
    [
        ("qwen3_moe", "qwen3_moe"),
        ("deepseek_v3", "deepseek_moe"),
        ("deepseek_v2", "deepseek_moe"),
        ("toy_moe", "toy_moe"),  # registered under a name and a path: one family
    ],
)
def test_lookup_by_model_type(model_type, family):
    assert family_for_model_type(model_type).name == family


def test_unknown_model_type_names_the_known_ones():
    with pytest.raises(ValueError, match="model_type='llama'.*deepseek_v2.*pass the family"):
        family_for_model_type("llama")
    with pytest.raises(ValueError, match="model_type=None"):
        family_for_model_type(None)


def test_user_family_hf_config_roundtrip():
    model = tiny_config("toy_moe")
    hf = TOY_MOE.to_hf(model)
    assert hf["model_type"] == "toy_moe"
    assert asdict(TOY_MOE.from_hf(hf)) | {"seq_length": 0} == asdict(model) | {"seq_length": 0}
    with pytest.raises(ValueError, match="model_type='toy_moe'.*'qwen3_moe' family"):
        get_family("qwen3_moe").from_hf(hf)


def test_user_family_tiny_checkpoint_matches_its_weight_map(tmp_path):
    """The toy's tiny checkpoint (written by its own transformers class) holds exactly
    the tensors its map names."""
    from moerl.convert import HFCheckpoint
    from moerl.models.hf_tiny import save_tiny_checkpoint

    model = tiny_config("toy_moe")
    ckpt = HFCheckpoint(save_tiny_checkpoint(model, tmp_path))
    assert ckpt.config()["architectures"] == ["ToyMoeForCausalLM"]
    fmap = TOY_MOE.weight_map(model)
    mapped = set()
    for entry in fmap.globals:
        mapped.update(fmap.hf_names(entry, None))
    for layer in range(model.num_layers):
        entries = fmap.moe_layer if layer >= fmap.first_moe_layer else fmap.dense_layer
        for entry in entries:
            experts = range(model.num_experts) if entry.expert else [None]
            for expert in experts:
                mapped.update(fmap.hf_names(entry, layer, expert))
    assert mapped == set(ckpt.names())


def test_register_family_refuses_duplicates_and_non_specs():
    from moerl.models import register_family

    with pytest.raises(ValueError, match="'toy_moe' is already registered"):
        register_family(TOY_MOE)
    with pytest.raises(TypeError, match="ModelFamily"):
        register_family("toy_moe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hf_model_types"):
        dataclasses.replace(TOY_MOE, hf_model_types=())


def _compose(*overrides: str):  # type: ignore[no-untyped-def]
    register_configs()
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_config_selects_a_user_family_by_import_path():
    cfg = validate_config(_compose("model=qwen3_moe_tiny", f"model.family={PATH}"), world_size=1)
    assert cfg.model.family == PATH


@pytest.mark.parametrize(
    "family, words",
    [
        ("llama", "model.family='llama' is not a registered model family; known: deepseek_moe"),
        ("no_such_pkg.FAMILY", "could not be imported as a ModelFamily"),
        ("families_for_tests.ToyMoeConfig", "imports a type, not a moerl.models.ModelFamily"),
    ],
)
def test_config_names_the_families_and_how_to_add_one(family, words):
    with pytest.raises(ValueError, match="model.family") as err:
        validate_config(_compose(f"model.family={family}"), world_size=1)
    assert words in str(err.value)
    if "." not in family:
        assert "import path of its ModelFamily" in str(err.value)


def test_replay_check_reads_deepseek_v2(tmp_path):
    """moerl.checks.replay finds the family by model_type through the registry, V2 included."""
    from safetensors.torch import save_file

    from moerl.checks.replay import checkpoint_model

    cfg = get_family("deepseek_moe").to_hf(tiny_config("deepseek_moe"))
    cfg.update(model_type="deepseek_v2", n_group=1, topk_group=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    model = checkpoint_model(tmp_path)
    assert model.family == "deepseek_moe"
    assert model.moe_router_score_function == "softmax"  # V2's router
    assert isinstance(get_family(model.family), ModelFamily)
