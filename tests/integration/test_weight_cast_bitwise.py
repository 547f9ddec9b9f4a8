"""A push lands the trainer's exact values in the engine's dtype (issue 30, the weight
path): fp32 values pushed to a bf16 or fp16 engine end up bit for bit as torch casts
them (round to nearest even), whether the trainer casts before sending (``sync.dtype``)
or sends fp32 and the engine's copy casts. What transformers keeps in float32 whatever
the model's dtype (DeepSeek-V3's router weights and score bias) stays float32 on the
wire too: a bf16 push used to round the router's weights the engine holds in float32.

The reference is independent of the engine's loading: the same fp32 values written as a
checkpoint and loaded by transformers in the engine's dtype; every tensor of the two
models is compared bit for bit. The engine runs in this process
(``launcher.placement=colocated``) so its parameters can be read."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moerl.engine.inprocess import InProcessEngine, engine_mounts
from moerl.rollout.client import EngineClient
from moerl.sync.weights import WeightSync, fp32_modules, kept_names


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(ints)


@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float16])
def test_a_push_lands_the_trainers_values_as_torch_casts_them(
    tiny_checkpoints, tmp_path, engine_dtype
):
    ckpt = tiny_checkpoints["deepseek_moe"]
    engine = InProcessEngine(ckpt, "--dtype", str(engine_dtype).removeprefix("torch."))
    try:
        stored = load_file(str(ckpt / "model.safetensors"))
        gen = torch.Generator().manual_seed(0)
        for version, (scale, sync_dtype) in enumerate(((1.37, None), (0.71, engine_dtype)), 1):
            # values whose low mantissa bits decide the rounding (truncation would differ)
            pushed = {
                n: (t.float() * scale + 1e-3 * torch.randn(t.shape, generator=gen)).contiguous()
                for n, t in stored.items()
            }
            client = EngineClient([engine.url], mounts=engine_mounts([engine]))
            keep = fp32_modules(ckpt)  # as the launcher passes it
            with WeightSync(
                [], None, client=client, transport="tensor", dtype=sync_dtype, keep_dtype=keep
            ) as sync:
                sync.push(version, named=pushed.items())

            ref_dir = tmp_path / f"ref{version}"
            ref_dir.mkdir()
            shutil.copy(ckpt / "config.json", ref_dir / "config.json")
            save_file(pushed, str(ref_dir / "model.safetensors"))
            ref = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=engine_dtype)
            want = ref.state_dict()
            got = engine.state.runner.model.state_dict()
            assert set(got) == set(want)
            for key, value in want.items():
                # transformers keeps some tensors in fp32 (the router's): both models do
                assert got[key].dtype == value.dtype, key
                assert torch.equal(_bits(got[key]), _bits(value)), (key, sync_dtype)
            cast = [k for k, v in want.items() if v.dtype == engine_dtype]
            assert len(cast) > len(want) // 2  # most of the model is in the engine's dtype
    finally:
        engine.close()


def test_the_modules_kept_in_float32_are_transformers_own(tiny_checkpoints):
    keep = fp32_modules(tiny_checkpoints["deepseek_moe"])
    assert "gate.weight" in keep and "e_score_correction_bias" in keep
    kept = kept_names(keep)
    assert kept is not None and kept_names([]) is None
    assert kept("model.layers.1.mlp.gate.weight")
    assert kept("model.layers.1.mlp.gate.e_score_correction_bias")
    assert not kept("model.layers.1.mlp.experts.0.gate_proj.weight")
    assert not kept("model.layers.1.mlp.up_gate.weight")
