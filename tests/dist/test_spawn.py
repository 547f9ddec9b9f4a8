"""How ``moerl.parallel.spawn`` starts a rank: with a CPU-only torch build, forked from a
forkserver that imported torch and megatron-core once; the rank still gets what a fresh
interpreter would have had from its spawner at the moment it starts (environment,
working directory, stdout/stderr)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.parallel.spawn import spawn, start_method


def _probe(out: str, say: bool = True) -> None:
    rank = dist.get_rank()
    if say:
        print(f"rank {rank} says hello on stdout", flush=True)
        print(f"rank {rank} says hello on stderr", file=sys.stderr, flush=True)
    seen = {
        "env": os.environ.get("MOERL_SPAWN_PROBE"),
        "gone": os.environ.get("MOERL_SPAWN_GONE"),
        "cwd": os.getcwd(),
        "ppid": os.getppid(),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(seen))


def test_the_start_method_follows_the_torch_build() -> None:
    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None)
    linux = sys.platform == "linux"
    assert start_method() == ("forkserver" if linux and not gpu_build else "spawn")


def test_a_rank_gets_the_spawners_environment_directory_and_output(
    tmp_path, monkeypatch, capfd
) -> None:
    """The second world is forked by a server started (here or by an earlier test) before
    the environment, the working directory and the output changed: the first world runs
    with pytest's capture off, so a server it starts writes where this process wrote
    then, not into the capture the second world's lines must reach."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.setenv("MOERL_SPAWN_GONE", "set before the server started")
    with capfd.disabled():
        spawn(_probe, 1, str(first), False, threads=1)
    monkeypatch.setenv("MOERL_SPAWN_PROBE", "set after")
    monkeypatch.delenv("MOERL_SPAWN_GONE")
    monkeypatch.chdir(second)
    spawn(_probe, 2, str(second), threads=1)
    out, err = capfd.readouterr()
    for rank in range(2):
        seen = json.loads((second / f"{rank}.json").read_text())
        assert seen["env"] == "set after"
        assert seen["gone"] is None
        assert Path(seen["cwd"]).resolve() == second.resolve()
        if start_method() == "forkserver":  # forked by the server, not by this process
            assert seen["ppid"] != os.getpid()
        assert f"rank {rank} says hello on stdout" in out
        assert f"rank {rank} says hello on stderr" in err
