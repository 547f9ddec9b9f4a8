"""The parts tools/gpu/run.py runs: each one's command, time limit and result parser.

Budgets (seconds of device time, the 8-minute plan of issue 28; a rerun must fit the
15 minutes too): install 30, part 1 120, part 2 120, part 3 180 (the CPU side of the mid
bf16 step is slow: 120 s ran out there on an H100 machine), part 4 100, part 5 150, part 6
120, part 7 120, part 8 150; part 9 (issue 30) 360 (300 ran out on an H200 with the mid shape), part 10 60. A session runs the parts it needs
(``--parts``), not all of them. ``dry_limit_s`` bounds the CPU dry run.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PY = sys.executable
GPU_TESTS = [
    "tests/unit/test_kernels_logprob.py",
    "tests/unit/test_kernels_lora_gmm.py",
    "tests/unit/test_kernels_replay_gather.py",
    # the embedded engine with --device cuda against transformers on CUDA
    "tests/unit/test_device.py",
    "tests/unit/test_engine_device.py",
    "tests/unit/test_engine_decode_graphs.py",
    "tests/integration/test_engine_device_run.py",
]
# the main job: the shipped recipe, 20 steps, trainer on the GPU (moerl.device picks it)
LAUNCH = ["-m", "moerl.launch", "+recipe=deepseek_moe"]


@dataclass(frozen=True)
class Part:
    number: int
    name: str
    argv: Callable[[Path, bool], list[str]]
    """(work folder, dry run) -> the command."""
    limit_s: float
    dry_limit_s: float = 120.0
    skip: str = ""
    """Why the part does not run (empty: it runs)."""
    sample_gpu_memory: bool = False


def _pytest(work: Path, dry: bool) -> list[str]:
    # the kernels' GPU tests skip without CUDA; the dry run checks they collect and import
    # -rfEs: each failure's reason in the summary; --tb=short keeps a failure readable
    # in the log's tail; per-test timeout well inside the part's limit
    return [PY, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "--tb=short", "--durations=5",
            "-p", "no:cacheprovider", "--timeout", "60", *GPU_TESTS]  # fmt: skip


def _kernels(work: Path, dry: bool) -> list[str]:
    device = ["--device", "cpu", "--quick"] if dry else ["--device", "cuda"]
    return [PY, "tools/bench/kernel_speed.py", *device, "--out", str(work / "kernels")]


def _step(work: Path, dry: bool) -> list[str]:
    if dry:  # both sides on the CPU, fp32 only: the same code, in the test's time
        extra = ["--device", "cpu", "--dtypes", "fp32", "--prompts", "2"]
    else:
        extra = ["--device", "cuda", "--dtypes", "fp32", "bf16", "--shapes", "tiny", "mid"]
    return [PY, "tools/gpu/step_parity.py", *extra, "--out", str(work / "step")]


def _launch(work: Path, dry: bool) -> list[str]:
    size = ["trainer.train_iters=20", "engine.threads=8"]
    if dry:  # the smallest run: two steps of one group, no warmup
        size = ["trainer.train_iters=2", "trainer.lr_warmup_steps=0", "engine.threads=1",
                "trainer.global_batch_size=4", "rollout.group_size=4", "rollout.max_new_tokens=4"]  # fmt: skip
    return [PY, *LAUNCH, *size, f"hydra.run.dir={work / 'run'}"]


def _launch_graphs(work: Path, dry: bool) -> list[str]:
    # part 5 with the engine's decode steps replayed as CUDA graphs (engine.cuda_graph)
    argv = _launch(work, dry)[:-1]
    graphs = ["engine.cuda_graph=true"]  # on the CPU: validated and passed on, no graphs
    return [*argv, *graphs, f"hydra.run.dir={work / 'graphs'}"]


def _colocated(work: Path, dry: bool) -> list[str]:
    # the engine inside the trainer's process on the same GPU, synchronous, asleep while
    # the trainer steps (launcher.sleep_engine's CUDA default), weights by CUDA IPC handle
    size = ["trainer.train_iters=10"]
    if dry:
        size = ["trainer.train_iters=2", "trainer.lr_warmup_steps=0",
                "trainer.global_batch_size=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
                "launcher.sleep_engine=true"]  # fmt: skip
    return [PY, *LAUNCH, "launcher.placement=colocated", "staleness=sync", *size,
            f"hydra.run.dir={work / 'colocated'}"]  # fmt: skip


def _engine(work: Path, dry: bool) -> list[str]:
    # fixed and long-tailed lengths against model.generate on the same device and weights,
    # the engine eager and with decode CUDA graphs (the CPU has none)
    if dry:
        size = ["--device", "cpu", "--only-generate", "--generate-shape", "tiny",
                "--prompts", "2", "--reps", "1", "--new-tokens", "4"]  # fmt: skip
    else:
        size = ["--device", "cuda", "--only-generate", "--prompts", "32", "--new-tokens", "32",
                "--reps", "2", "--cuda-graph", "both"]  # fmt: skip
    return [PY, "tools/bench/engine.py", *size]


def _run_all(work: Path, dry: bool) -> list[str]:
    # the suite's GPU section: its kernel bench on this machine's device, rendered by
    # tools/bench/report.py (the README's "GPU" table comes from it on a CUDA machine)
    size = "--smoke" if dry else "--quick"
    return [PY, "tools/bench/run_all.py", size, "--only", "kernels", "--out",
            str(work / "run_all")]  # fmt: skip


def _true_on_policy(work: Path, dry: bool) -> list[str]:
    # issue 30 on the GPU: the batch-invariant engine (fp32, bf16; both families) and the
    # matching trainer, single layout (one GPU); invariance, engine = trainer, overheads
    if dry:
        size = ["--device", "cpu", "--quick", "--reps", "1", "--new-tokens", "4", "--no-mid"]
    else:
        size = ["--device", "cuda", "--layouts", "single", "--run-steps", "0", "--reps", "3",
                "--no-mid"]  # fmt: skip
    return [PY, "tools/bench/true_on_policy.py", *size, "--out", str(work / "top")]


def _probe(work: Path, dry: bool) -> list[str]:
    # which batch-invariant op keeps a row's bits on this device (part 9's diagnosis)
    device = ["--device", "cpu"] if dry else ["--device", "cuda"]
    return [PY, "tools/gpu/probe_invariance.py", *device, "--out", str(work / "probe.json")]


def _skipped(work: Path, dry: bool) -> list[str]:
    return []


PARTS = [
    Part(1, "pytest -m gpu (kernels vs torch twins)", _pytest, 120, dry_limit_s=60),
    Part(2, "bench kernels on cuda", _kernels, 120, dry_limit_s=60),
    Part(3, "RL step cuda vs cpu", _step, 180, dry_limit_s=90),
    Part(4, "engine vs model.generate on cuda", _engine, 100, dry_limit_s=90),
    Part(
        5,
        "main job on one GPU (deepseek_moe, 20 steps)",
        _launch,
        150,
        dry_limit_s=90,
        sample_gpu_memory=True,
    ),  # fmt: skip
    Part(6, "run_all.py GPU section", _run_all, 120, dry_limit_s=90),
    Part(
        7,
        "main job colocated on one GPU (sync, engine asleep while training, 10 steps)",
        _colocated,
        120,
        dry_limit_s=90,
        sample_gpu_memory=True,
    ),  # fmt: skip
    Part(
        8,
        "main job on one GPU, engine decode CUDA graphs (engine.cuda_graph=true, 20 steps)",
        _launch_graphs,
        150,
        dry_limit_s=90,
        sample_gpu_memory=True,
    ),  # fmt: skip
    Part(9, "true on-policy on cuda (batch-invariant engine and trainer)", _true_on_policy, 360),
    Part(10, "batch-invariant ops probed one by one on cuda", _probe, 60, dry_limit_s=60),
]


def _pytest_results(work: Path, log: Path) -> dict[str, Any]:
    text = log.read_text(errors="replace")
    # -q ends with e.g. "5 passed, 63 deselected in 9.81s" (no ===== frame)
    tail = re.findall(
        r"^=*\s*(\d+ (?:passed|failed|skipped|error|deselected).*?)\s*=*$", text, re.M
    )
    return {"pytest": tail[-1] if tail else "no summary line"}


def _kernels_results(work: Path, log: Path) -> dict[str, Any]:
    rows = json.loads((work / "kernels" / "result.json").read_text())["rows"]
    keep = ("kernel_ms", "torch_ms", "speedup", "kernel_peak_mb", "torch_peak_mb", "mem_ratio")
    return {f"{r['kernel']}@{r['size']}": {k: r[k] for k in keep} for r in rows}


def _step_results(work: Path, log: Path) -> dict[str, Any]:
    rows = json.loads((work / "step" / "result.json").read_text())
    keys = ("loss_abs", "grad_norm_rel", "grad_rel", "update_rel", "ok")
    return {f"{r['shape']}/{r['dtype']}": {k: r[k] for k in keys} for r in rows}


def _launch_results(work: Path, log: Path, run: str = "run") -> dict[str, Any]:
    lines = (work / run / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if line.strip()]
    out: dict[str, Any] = {
        "steps": len(steps),
        "reward_mean": [round(s.get("reward_mean", float("nan")), 3) for s in steps],
        "s_per_step_median": statistics.median(s["step_s"] for s in steps if "step_s" in s),
        "sync_s_median": statistics.median(s["sync/seconds"] for s in steps if "sync/seconds" in s),
        "wall_s": steps[-1].get("time_s"),
    }
    mem = work / "gpu_mem.csv"
    if mem.exists():
        used = [int(x) for x in mem.read_text().split() if x.strip().isdigit()]
        out["peak_gpu_mem_mib"] = max(used) if used else None
    return out


def _colocated_results(work: Path, log: Path) -> dict[str, Any]:
    out = _launch_results(work, log, "colocated")
    last = json.loads((work / "colocated" / "metrics.jsonl").read_text().splitlines()[-1])
    out["engine_slept_steps"] = last.get("engine/sleep_slept", 0)
    out["onpolicy_log_ratio_abs_max"] = last.get("mismatch/onpolicy_log_ratio_abs_max")
    return out


def _graphs_results(work: Path, log: Path) -> dict[str, Any]:
    return _launch_results(work, log, "graphs")


def _engine_results(work: Path, log: Path) -> dict[str, Any]:
    # the bench's summary lines: "engine lengths=fixed engine_tok_s=… hf_tok_s=… ratio=…"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("engine ")]
    return {"lines": lines[-8:]}  # eager and graphs: two lengths, captures, group


def _run_all_results(work: Path, log: Path) -> dict[str, Any]:
    results = json.loads((work / "run_all" / "results.json").read_text())
    return {"device": results.get("machine", {}).get("device"),
            "benches": {k: v.get("status") for k, v in results.get("benches", {}).items()}}  # fmt: skip


def _true_on_policy_results(work: Path, log: Path) -> dict[str, Any]:
    r = json.loads((work / "top" / "result.json").read_text())
    keys = ("device", "engine_invariant", "engine_scenarios", "engine_invariant_off",
            "engine_overhead", "engine_overhead_mid", "layouts_exact", "abs_diff_max",
            "abs_diff_max_off", "trainer_overhead", "trainer_overhead_mid", "k3_on", "k3_off",
            "bf16_exact", "bf16_total")  # fmt: skip
    out = {k: r.get(k) for k in keys}
    out["invariant_on"] = {k: v["invariant_on"] for k, v in r["settings"].items()}
    out["bf16_abs_diff_max"] = {
        family: m["on"]["abs_diff_max"] for family, m in r.get("trainer_bf16", {}).items()
    }
    return out


def _probe_results(work: Path, log: Path) -> dict[str, Any]:
    found = json.loads((work / "probe.json").read_text())
    return {"device": found["device"], "products": found.get("products", "torch"),
            "invariant": f"{found['invariant']}/{found['total']}",
            "differs": {k: len(v) for k, v in found["ops"].items() if v}}  # fmt: skip


def parse_results(number: int, work: Path, log: Path) -> dict[str, Any]:
    parsers = {
        1: _pytest_results,
        2: _kernels_results,
        3: _step_results,
        4: _engine_results,
        5: _launch_results,
        6: _run_all_results,
        7: _colocated_results,
        8: _graphs_results,
        9: _true_on_policy_results,
        10: _probe_results,
    }
    return parsers[number](work, log) if number in parsers else {}
