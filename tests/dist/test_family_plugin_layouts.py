"""A model family from test code (tests/families_for_tests.py, no moerl edits) converts
like the shipped ones: HF → Megatron gives transformers' logits, the export and the
megatron-core checkpoint round trip reproduce its checkpoint bit for bit. Spawned ranks
find it by its import path alone."""

from __future__ import annotations

import json

import pytest
import torch
from families_for_tests import PATH

from moerl.checks.conversion import LOGIT_TOL, check_layout, prepare
from moerl.models.hf_tiny import save_tiny_checkpoint
from moerl.models.tiny import tiny_config
from moerl.parallel import spawn


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    work = tmp_path_factory.mktemp("toy")
    model = tiny_config(PATH)
    hf = save_tiny_checkpoint(model, work / "hf")
    prepare(hf, work, model.vocab_size)
    return hf, work


@pytest.mark.parametrize("layout", ["single", "ep2"])
def test_user_family_converts_and_exports(layout, toy):
    hf, work = toy
    result = check_layout(PATH, layout, hf, work)
    assert result.ok, result.line()
    assert result.max_logit_abs_diff <= LOGIT_TOL and result.roundtrip_exact


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_user_family_megatron_checkpoint_roundtrip(toy, tmp_path):
    from safetensors import safe_open

    from moerl.convert import HFCheckpoint
    from moerl.convert.mcore_ckpt import MODEL_JSON, hf_to_mcore, mcore_to_hf

    hf, _ = toy
    spawn(hf_to_mcore, 1, str(hf), str(tmp_path / "mc"), "single", PATH)
    assert json.loads((tmp_path / "mc" / MODEL_JSON).read_text())["family"] == PATH
    spawn(mcore_to_hf, 1, str(tmp_path / "mc"), str(tmp_path / "hf"), "single", 1000.0)
    back = HFCheckpoint(tmp_path / "hf")
    assert back.config()["model_type"] == "toy_moe"
    assert HFCheckpoint(hf).names() == back.names()
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), back.get(name)), name
