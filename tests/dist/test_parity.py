"""Every parallel layout trains like the single process (multi-process gloo on CPU).

The default run checks two representative layouts: pp2 (megatron-core's 1F1B
pipeline schedule with p2p) and tp2ep2 (tensor + sequence parallel, expert
parallel with expert-TP, alltoall dispatch, distributed optimizer over DP=2).
``pytest -m slow`` checks all of them, and plain DDP.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moerl.checks.parity import FP32_TOL, ParityConfig, run_layout, run_reference

DEFAULT = ["pp2", "tp2ep2"]
OTHER_LAYOUTS = ["tp2", "ep2", "etp2ep2", "tp2pp2", "dp2ep2", "tp2etp1ep2", "pp2dp2"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("parity")
    cfg = ParityConfig()
    run_reference(workdir, cfg)
    return workdir, cfg


def _check(layout: str, workdir: Path, cfg: ParityConfig) -> None:
    result = run_layout(layout, workdir, cfg)
    assert result.ok, result.line()
    assert result.loss_rel_err <= FP32_TOL and result.grad_rel_err <= FP32_TOL
    # Replicated copies of a tensor (DP ranks, TP-replicated norms) agree exactly
    # after the gradient sync: this catches a missing sequence-parallel all-reduce.
    assert result.replica_max_abs_diff <= FP32_TOL


@pytest.mark.parametrize("layout", DEFAULT)
def test_layout_matches_single_process(layout, reference):
    _check(layout, *reference)


# every other layout: since ranks fork from a server that imported torch and
# megatron-core once (moerl/parallel/spawn.py), a layout costs seconds, not a fresh import
# per rank, and all of them run by default
@pytest.mark.parametrize("layout", OTHER_LAYOUTS)
def test_other_layouts_match_single_process(layout, reference):
    _check(layout, *reference)


@pytest.mark.parametrize("layout", ["ep2", "tp2ep2", "etp2ep2"])
def test_allgather_dispatcher_matches_single_process(layout, tmp_path):
    cfg = ParityConfig(dispatcher="allgather")
    run_reference(tmp_path, cfg)
    _check(layout, tmp_path, cfg)


def test_plain_ddp_matches_single_process(tmp_path):
    cfg = ParityConfig(use_distributed_optimizer=False)
    run_reference(tmp_path, cfg)
    _check("dp2ep2", tmp_path, cfg)


def test_parity_detects_a_wrong_start(reference, tmp_path):
    """The comparison can fail: perturb one reference gradient and the layout FAILs."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    workdir, cfg = reference
    for f in workdir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    grads = load_file(str(tmp_path / "grads.safetensors"))
    key = "decoder.layers.1.mlp.router.weight"
    grads[key] = grads[key] + 1e-3 * torch.ones_like(grads[key])
    save_file(grads, str(tmp_path / "grads.safetensors"))
    result = run_layout("pp2", tmp_path, cfg)
    assert not result.ok
    assert result.worst_grad == key


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_check_parallel_cli_prints_one_line_per_layout():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_parallel.py"), "--layouts", "pp2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("layout=")]
    assert len(lines) == 1
    assert lines[0].startswith("layout=pp2 loss_rel_err=") and " grad_rel_err=" in lines[0]
    assert lines[0].split("(")[0].rstrip().endswith(" ok")


@pytest.fixture(scope="module")
def replay_reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("parity-replay")
    cfg = ParityConfig(replay=True)
    run_reference(workdir, cfg)
    return workdir, cfg


def test_replay_matches_single_process_replayed_run(replay_reference, reference):
    """Keep Routing under tp2ep2 (sequence-parallel slices, EP, distributed optimizer)
    gives the single-process replayed loss and gradients; and replay is not a no-op."""
    import json

    _check("tp2ep2", *replay_reference)
    replayed = json.loads((replay_reference[0] / "losses.json").read_text())
    plain = json.loads((reference[0] / "losses.json").read_text())
    assert abs(replayed["loss1"] - plain["loss1"]) > 1e-5


@pytest.mark.parametrize("layout", ["tp2", "pp2", "ep2", "etp2ep2", "tp2pp2", "dp2ep2"])
def test_replay_matches_the_replayed_run_in_other_layouts(layout, replay_reference):
    _check(layout, *replay_reference)
