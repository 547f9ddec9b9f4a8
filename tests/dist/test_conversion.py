"""HF ⇄ Megatron conversion under parallel layouts, bad checkpoints, streaming export."""

from __future__ import annotations

import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from moerl.checks.conversion import LOGIT_TOL, check_layout, prepare
from moerl.models.hf_tiny import save_tiny_checkpoint
from moerl.models.tiny import tiny_config
from moerl.parallel import spawn

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = [("deepseek_moe", "single"), ("deepseek_moe", "tp2ep2"), ("qwen3_moe", "pp2")]
SLOW = [
    ("deepseek_moe", "tp2"),
    ("deepseek_moe", "ep2"),
    ("deepseek_moe", "pp2"),
    ("qwen3_moe", "single"),
    ("qwen3_moe", "tp2"),
    ("qwen3_moe", "ep2"),
    ("qwen3_moe", "tp2ep2"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in ("deepseek_moe", "qwen3_moe"):
        work = tmp_path_factory.mktemp(family)
        model = tiny_config(family)
        hf = save_tiny_checkpoint(model, work / "hf")
        prepare(hf, work, model.vocab_size)
        out[family] = (hf, work)
    return out


def _check(family, layout, checkpoints):
    hf, work = checkpoints[family]
    result = check_layout(family, layout, hf, work)
    assert result.ok, result.line()
    assert result.max_logit_abs_diff <= LOGIT_TOL and result.roundtrip_exact


@pytest.mark.parametrize("family, layout", DEFAULT)
def test_conversion(family, layout, checkpoints):
    _check(family, layout, checkpoints)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", SLOW)
def test_conversion_slow(family, layout, checkpoints):
    _check(family, layout, checkpoints)


def _bad_inputs(hf_dir: str, other_dir: str, scratch: str) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from moerl.convert import CheckpointError, load_hf
    from moerl.models.gpt import build_model
    from moerl.parallel import initialize_model_parallel, parse_layout

    model = tiny_config("deepseek_moe")
    pcfg, _ = parse_layout("single")
    initialize_model_parallel(pcfg, num_layers=4, num_attention_heads=4, num_experts=8)
    chunks = build_model(model, pcfg)
    before = {k: v.clone() for k, v in chunks[0].state_dict().items() if torch.is_tensor(v)}

    def variant(name: str, edit) -> Path:  # type: ignore[no-untyped-def]
        path = Path(scratch) / name
        shutil.copytree(hf_dir, path)
        tensors = load_file(str(path / "model.safetensors"))
        edit(tensors, path)
        save_file(tensors, str(path / "model.safetensors"))
        return path

    def expect(path, *words):  # type: ignore[no-untyped-def]
        try:
            load_hf(chunks, path, model)
        except (CheckpointError, ValueError) as err:
            for word in words:
                assert word in str(err), (word, str(err))
        else:
            raise AssertionError(f"{path} loaded without error")

    # a checkpoint of another family
    expect(other_dir, "model_type='qwen3_moe'", "deepseek_moe")
    # a config that disagrees with the model
    cfg_path = variant("cfg", lambda t, p: None)
    cfg = json.loads((cfg_path / "config.json").read_text())
    cfg["hidden_size"] = 96
    (cfg_path / "config.json").write_text(json.dumps(cfg))
    expect(cfg_path, "hidden_size")
    # a missing tensor
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    expect(variant("missing", lambda t, p: t.pop(name)), "lacks 1 tensors", name)
    # a tensor of the wrong shape
    bad = "model.layers.1.self_attn.kv_b_proj.weight"
    expect(variant("shape", lambda t, p: t.update({bad: t[bad][:-1]})), bad, "model.safetensors")
    # a tensor the model has no place for
    extra = "model.layers.9.mlp.gate.weight"
    expect(variant("extra", lambda t, p: t.update({extra: torch.zeros(2)})), extra, "no place")
    # nothing was half-loaded by any failed attempt
    after = chunks[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the ignore patterns make unknown tensors explicit, not silent
    report = load_hf(chunks, Path(scratch) / "extra", model, ignore=("model.layers.9.*",))
    assert report.ignored == [extra]


def test_bad_checkpoints_fail_clearly(checkpoints, tmp_path):
    spawn(
        _bad_inputs,
        1,
        str(checkpoints["deepseek_moe"][0]),
        str(checkpoints["qwen3_moe"][0]),
        str(tmp_path),
    )


def _streaming(hf_dir: str) -> None:
    from moerl.convert import export_hf, load_hf
    from moerl.models.gpt import build_model
    from moerl.parallel import initialize_model_parallel, parse_layout

    model = tiny_config("qwen3_moe")
    pcfg, _ = parse_layout("ep2")
    initialize_model_parallel(
        pcfg, num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=8
    )
    chunks = build_model(model, pcfg)
    load_hf(chunks, hf_dir, model)
    refs: list[tuple[weakref.ref, int]] = []
    biggest_key = 0
    current: list[int] = []
    last_prefix = None
    for name, tensor in export_hf(chunks, model):
        # tensors that came from one Megatron tensor (or one expert) share a prefix
        prefix = name.rsplit(".", 2)[0]
        if prefix != last_prefix:
            current, last_prefix = [], prefix
        current.append(tensor.numel() * tensor.element_size())
        biggest_key = max(biggest_key, sum(current))
        refs.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
        del tensor
        alive = sum(size for ref, size in refs if ref() is not None)
        # the consumer dropped every tensor: the generator keeps at most the tensors of
        # the Megatron tensor it is converting, never an accumulation
        assert alive <= biggest_key, (name, alive, biggest_key)
    total = sum(size for _, size in refs)
    assert total > 5 * biggest_key  # the bound is far below the model size


def test_export_streams_one_tensor_at_a_time(checkpoints):
    spawn(_streaming, 2, str(checkpoints["qwen3_moe"][0]))


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_convert_checkpoint_roundtrip(checkpoints, tmp_path):
    from safetensors import safe_open

    from moerl.convert import HFCheckpoint

    hf, _ = checkpoints["qwen3_moe"]
    tool = str(ROOT / "tools" / "convert_checkpoint.py")
    run = dict(capture_output=True, text=True, timeout=600)
    a = subprocess.run(
        [
            sys.executable,
            tool,
            "hf2mcore",
            "--hf-dir",
            str(hf),
            "--out",
            str(tmp_path / "mc"),
            "--layout",
            "ep2",
        ],
        **run,
    )
    assert a.returncode == 0, a.stderr[-3000:]
    b = subprocess.run(
        [
            sys.executable,
            tool,
            "mcore2hf",
            "--mcore-dir",
            str(tmp_path / "mc"),
            "--out",
            str(tmp_path / "hf"),
            "--layout",
            "pp2",
            "--shard-mb",
            "0.2",
        ],
        **run,
    )
    assert b.returncode == 0, b.stderr[-3000:]
    original, back = HFCheckpoint(hf), HFCheckpoint(tmp_path / "hf")
    assert original.names() == back.names()
    assert len(set(back.files.values())) > 2  # sharded by --shard-mb, one set per stage
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), back.get(name)), name


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_check_conversion_cli():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "check_conversion.py"),
            "--family",
            "qwen3_moe",
            "--layouts",
            "single",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("family="))
    assert line.startswith("family=qwen3_moe layout=single max_logit_abs_diff=")
    assert "roundtrip=exact" in line


def _live_shards_follow_updates(family: str) -> None:
    from moerl.models.gpt import build_model
    from moerl.parallel import initialize_model_parallel, parse_layout
    from moerl.parallel.full_state import live_shards, local_shards

    model = tiny_config(family)
    pcfg, _ = parse_layout("single")
    initialize_model_parallel(
        pcfg, num_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
        num_experts=model.num_experts,
    )  # fmt: skip
    chunks = build_model(model, pcfg)
    first = live_shards(chunks)
    assert live_shards(chunks) is first  # every shard is a view of a parameter: reused
    with torch.no_grad():  # an optimizer step writes into the parameters
        for i, param in enumerate(chunks[0].parameters()):
            param.add_(0.5 + i)
    again, fresh = live_shards(chunks), local_shards(chunks)
    assert again is first
    assert [s.key for s in again] == [s.key for s in fresh]
    for old, new in zip(again, fresh, strict=True):
        assert torch.equal(old.data, new.data), old.key
    param = next(chunks[0].parameters())
    param.data = param.data.clone()  # moved: the cached list no longer describes it
    rebuilt = live_shards(chunks)
    assert rebuilt is not first
    assert any(s.data.data_ptr() == param.data_ptr() for s in rebuilt)


@pytest.mark.parametrize("family", ["deepseek_moe", "qwen3_moe"])
def test_live_shards_follow_in_place_updates(family):
    """The export's cached shard list sees optimizer updates and is rebuilt when a
    parameter moves (checked against a fresh sharded state dict)."""
    spawn(_live_shards_follow_updates, 1, family)
