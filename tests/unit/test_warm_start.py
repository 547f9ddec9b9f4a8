"""The launcher's early engine start: which runs start warm engine processes and with
which command lines (``moerl.launch.warm_engines``), how a CPU-only torch is told without
importing it (moerl/common/torch_build.py) and the order an engine started with
``--await-start`` reads (moerl/engine/__main__.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from configs_for_tests import compose_config

from moerl.common.torch_build import _version_fields, cpu_only_build
from moerl.config.threads import resolve_threads
from moerl.engine.__main__ import read_order
from moerl.launch import policy_engine_flags, warm_engines

VERSION_PY = {
    "cpu": "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n",
    "cuda": "__version__ = '2.13.0+cu128'\ncuda = '12.8'\nhip: Optional[str] = None\n",
    "rocm": "__version__ = '2.13.0+rocm6.4'\ncuda = None\nhip = '6.4.1'\n",
    "old": "__version__ = '1.0'\ncuda = None\n",  # no hip field: not told
}


@pytest.mark.parametrize(("build", "cpu_only"), [("cpu", True), ("cuda", False), ("rocm", False)])
def test_a_torch_builds_gpu_toolkit_is_read_from_its_version_file(tmp_path, build, cpu_only):
    path = tmp_path / "version.py"
    path.write_text("from typing import Optional\n" + VERSION_PY[build])
    fields = _version_fields(path)
    assert fields is not None
    assert all(fields[f] is None for f in ("cuda", "hip")) is cpu_only


def test_an_unreadable_or_incomplete_version_file_is_not_taken_for_cpu_only(tmp_path):
    assert _version_fields(tmp_path / "missing.py") is None
    (tmp_path / "bad.py").write_text("cuda = (\n")
    assert _version_fields(tmp_path / "bad.py") is None
    (tmp_path / "old.py").write_text(VERSION_PY["old"])
    assert "hip" not in (_version_fields(tmp_path / "old.py") or {})


def test_cpu_only_build_agrees_with_torch_and_does_not_import_it():
    """In a fresh interpreter: the answer read from the files, torch still unimported,
    then torch's own."""
    code = (
        "import sys; from moerl.common.torch_build import cpu_only_build; "
        "told = cpu_only_build(); loaded = 'torch' in sys.modules; import torch; "
        "print(told, loaded, torch.version.cuda is None and torch.version.hip is None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    told, loaded, truth = out.stdout.split()
    assert loaded == "False" and told == truth
    assert cpu_only_build() is (truth == "True")  # torch imported here: read from it


@pytest.mark.parametrize(
    ("overrides", "started"),
    [
        (["+recipe=deepseek_moe"], True),
        (["+recipe=deepseek_moe", "staleness=sync", "engine.threads=1"], True),
        (["+recipe=deepseek_moe", "engine.num_engines=2", "launcher.threads=1"], True),
        (["+recipe=deepseek_moe", "launcher.placement=colocated"], False),
        (["engine.kind=sglang", "engine.urls=[http://127.0.0.1:1]"], False),
        (["+recipe=deepseek_moe", "launcher.dry_run=true"], False),
        (["+recipe=deepseek_moe", "lora.enabled=true"], False),
    ],
)
def test_warm_engines_start_one_per_embedded_engine_with_its_flags_and_threads(
    monkeypatch, tmp_path, overrides, started
):
    if not cpu_only_build():
        pytest.skip("a GPU build of torch: the launcher asks torch, so starts no warm engine")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = compose_config(*overrides)
    warm = warm_engines(cfg, tmp_path)
    try:
        if not started:
            assert warm == []
            return
        from moerl.validate import validate_config

        typed = validate_config(cfg)
        split = resolve_threads(typed, typed.launcher.world_size(), has_cuda=False)
        assert len(warm) == typed.engine.count()
        assert all(w.threads == split.engine for w in warm)
        assert all(w.env["OMP_NUM_THREADS"] == str(split.engine) for w in warm)
        assert all(w.proc.poll() is None for w in warm)
        model = str(tmp_path / "init_hf")  # no model.path: the launcher writes one there
        for w in warm:
            assert w.argv[w.argv.index("--model-path") + 1] == model
            assert w.argv[w.argv.index("--port") + 1] == str(w.port)
            assert w.argv[-len(policy_engine_flags(typed)) :] == policy_engine_flags(typed)
        assert len({w.port for w in warm}) == len(warm)
    finally:
        for w in warm:
            w.close()


def test_no_warm_engine_under_torchrun_or_for_a_config_the_preflight_refuses(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert warm_engines(compose_config("+recipe=deepseek_moe"), tmp_path) == []
    monkeypatch.delenv("RANK")  # WORLD_SIZE=2 against launcher.nproc=3: refused
    assert warm_engines(compose_config("+recipe=deepseek_moe", "launcher.nproc=3"), tmp_path) == []


def test_an_awaiting_engine_reads_one_order_line():
    order = {"log": "/tmp/e.log", "env": {"MOERL_API_KEY": "k"}}
    assert read_order(json.dumps(order) + "\n") == order
    assert read_order(json.dumps({"log": "/tmp/e.log"})) == {"log": "/tmp/e.log"}
    assert read_order("") is None and read_order("\n") is None  # end of input: quietly
    with_env = {"log": "/tmp/e.log", "env": {"TORCHINDUCTOR_CACHE_DIR": "/tmp/i"}}
    assert read_order(json.dumps(with_env)) == with_env
    for bad in ('{"env": {}}', '{"log": 3}', "[]"):
        with pytest.raises(ValueError, match="the order needs its log file"):
            read_order(bad)
    with pytest.raises(ValueError, match="env must be an object"):
        read_order('{"log": "/tmp/e.log", "env": ["A=1"]}')
    with pytest.raises(ValueError):
        read_order("not json")
