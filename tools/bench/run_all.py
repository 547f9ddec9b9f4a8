"""Run every benchmark, then write the results page.

    python tools/bench/run_all.py [--quick | --smoke] [--only a,b] [--out bench/]
                                  [--timeout-s S] [--readme README.md] [--merge]

Benches (each ``tools/bench/<name>.py``, called as ``main([...])``): engine,
async_vs_sync, weight_sync, replay_overhead, mismatch, lora_sync, kernels, offpolicy, episodes, rewards,
scaling, vs_trl (TRL from the `bench` extra; skipped without it), true_on_policy. Each runs in
a fresh child process (several make their own process a one-rank gloo world, which must
not leak into the next), in its own session so a timeout (``--timeout-s``, else a
per-bench default) kills it with everything it started. A bench that fails or times out
is recorded as such; the others still run. Per bench: ``OUT/<name>/result.json`` (the
bench's own, or the dict its ``main`` returned), ``OUT/<name>/log.txt``, and in
``OUT/results.json`` its status, exit code, wall time, arguments and output tail.

Then ``OUT/results.json`` (machine: platform, CPU count, torch / megatron-core / triton
versions, device, date, git commit, load average; the per-bench records), the plots
``OUT/plots/*.png`` and ``OUT/REPORT.md`` (headline ratios beside the issues' targets,
published anchors, GPU section; ``report.py``). ``--readme FILE`` also replaces the text
between ``<!-- results:start -->`` and ``<!-- results:end -->`` in FILE with
``report.readme_section``. ``--render-only`` re-renders the page from an existing
``OUT/results.json`` without running anything; ``--merge`` runs only the named benches
and replaces their records in it, each stamped with its own commit, date and mode (the
page lists them under its machine line).

Modes: full (each bench's defaults; tens of minutes to hours on a CPU box), ``--quick``
(each bench's ``--quick``, with more repeats or configs where one run of the quick
setting says little; see ``SUITE``; about 7 minutes on 2 busy cores, budget 15) and
``--smoke`` (the smallest settings, for tests).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# name -> (passes --out, {mode: argv}, {mode: timeout_s})
SUITE: dict[str, tuple[bool, dict[str, list[str]], dict[str, int]]] = {
    "engine": (False, {"full": [], "quick": ["--quick"],
                       "smoke": ["--quick", "--generate-shape", "tiny"]},
               {"full": 1800, "quick": 300, "smoke": 300}),
    # quick: three sync/async pairs (medians): one pair of ~10 s loops is mostly noise
    "async_vs_sync": (True, {"full": [], "quick": ["--quick", "--repeats", "3"],
                             "smoke": ["--quick", "--steps", "2"]},
                      {"full": 3600, "quick": 600, "smoke": 300}),
    # quick: the mid config too (the tiny model fits in one bucket of every size), 3 reps
    "weight_sync": (True, {"full": [], "quick": ["--quick", "--mid", "--reps", "3"],
                           "smoke": ["--quick", "--buckets-mb", "1", "64"]},
                    {"full": 1800, "quick": 300, "smoke": 120}),
    "replay_overhead": (True, {"full": [], "quick": ["--quick", "--prompts", "16", "--reps", "9"],
                               "smoke": ["--quick", "--prompts", "4", "--new-tokens", "8",
                                         "--reps", "1"]},
                        {"full": 1800, "quick": 240, "smoke": 180}),
    # quick: check_replay's default set (16 x 32 tokens); fewer tokens rarely flip a route;
    # then both real router geometries with bf16 and fp32 engines (~4 min on 2 cores)
    "mismatch": (True, {"full": ["--geometries", "all"],
                        "quick": ["--quick", "--prompts", "16", "--new-tokens", "32",
                                  "--geometries", "all"],
                        "smoke": ["--quick", "--prompts", "4", "--new-tokens", "8"]},
                 {"full": 3600, "quick": 600, "smoke": 180}),
    # quick: the mid shapes too (the targets are for them), one repeat each
    "lora_sync": (True, {"full": [], "quick": ["--quick", "--configs", "tiny", "mid", "mid_ds"],
                         "smoke": ["--quick", "--rank", "8", "--transports", "tensors"]},
                  {"full": 3600, "quick": 420, "smoke": 240}),
    "kernels": (True, {"full": [], "quick": ["--quick"], "smoke": ["--quick"]},
                {"full": 1800, "quick": 180, "smoke": 120}),
    # 3 staleness bounds x 3 variants, each a short training run
    "offpolicy": (True, {"full": [], "quick": ["--quick"],
                         "smoke": ["--quick", "--steps", "2", "--staleness", "1"]},
                  {"full": 3600, "quick": 900, "smoke": 300}),
    # inline vs async scoring by a lognormal-latency reward model (~40 s)
    "rewards": (True, {"full": [], "quick": ["--quick"], "smoke": ["--quick", "--steps", "3"]},
                {"full": 900, "quick": 300, "smoke": 240}),
    # a sync and an async run of 3-turn episodes with lognormal env latency, then turn timings
    "episodes": (True, {"full": [], "quick": ["--quick"],
                        "smoke": ["--quick", "--steps", "3", "--turn-episodes", "1"]},
                 {"full": 1800, "quick": 420, "smoke": 300}),
    # cost curves: trainer, sync and engine costs vs hidden size, experts, sequence, top-k
    # (full ~15 min); smoke: two tiny models of the hidden sweep, every metric
    "scaling": (True, {"full": [], "quick": ["--quick"],
                       "smoke": ["--smoke", "--sweeps", "hidden"]},
                {"full": 2400, "quick": 600, "smoke": 180}),
    # moerl sync and async against TRL's GRPOTrainer (the `bench` extra; without TRL the
    # bench records that it was skipped); full: the recipe's 40 steps, 3 alternating rounds,
    # the recipe's placement and the colocated one side by side
    "vs_trl": (True, {"full": ["--repeats", "3", "--placements", "recipe,colocated"],
                      "quick": ["--steps", "8"],
                      "smoke": ["--quick"]},
               {"full": 3600, "quick": 600, "smoke": 300}),
    # issue 30: the engine's batch-invariant mode, scenarios with the alone run's bits and
    # its overhead on the tiny and mid shapes (~1 min quick)
    "true_on_policy": (True, {"full": [], "quick": ["--quick"],
                              "smoke": ["--quick", "--reps", "1", "--new-tokens", "6"]},
                       {"full": 2400, "quick": 300, "smoke": 180}),
}  # fmt: skip
NOISE = ("UserWarning", "warnings.warn(", "Writing model shards")
SCRIPTS = {"kernels": "kernel_speed"}
"""A bench's script where its file is not named after it: a script's folder is first on
``sys.path``, and a file named ``kernels.py`` there would stand in for the ``kernels``
distribution that transformers imports."""


def _script(name: str) -> str:
    """The file name (without .py) of a bench or module beside this file."""
    return SCRIPTS.get(name, name)


@functools.cache
def _load(name: str):  # type: ignore[no-untyped-def]
    """A module beside this file (benches are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"moerl_bench_{name}", HERE / f"{_script(name)}.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become None, tuples lists, keys strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _child(name: str, out: Path, argv: list[str]) -> None:
    """In the bench's own process: ``main(argv)``; keep what it returned when it wrote no
    result.json itself."""
    result = _load(name).main(argv)
    path = out / "result.json"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_clean(result), indent=1) + "\n")


def _tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    kept = [x for x in text.splitlines() if not any(n in x for n in NOISE)]
    return "\n".join(kept[-lines:])


def run_bench(name: str, mode: str, out: Path, timeout_s: int | None) -> dict[str, Any]:
    """One bench in a fresh process group; its record for results.json."""
    takes_out, argvs, timeouts = SUITE[name]
    bench_dir = out / name
    bench_dir.mkdir(parents=True, exist_ok=True)
    (bench_dir / "result.json").unlink(missing_ok=True)
    argv = [*argvs[mode], *(["--out", str(bench_dir)] if takes_out else [])]
    limit = timeout_s or timeouts[mode]
    log = bench_dir / "log.txt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "_child", name, str(bench_dir), *argv]
    start = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            rc: int | None = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            status, rc = f"timeout after {limit}s", None
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                try:
                    os.killpg(proc.pid, sig)  # the bench's own group: engines, spawned ranks
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
    wall = time.perf_counter() - start
    result = None
    if (bench_dir / "result.json").exists():
        try:
            result = json.loads((bench_dir / "result.json").read_text())
        except json.JSONDecodeError as err:
            status = f"failed (unreadable result.json: {err})"
    if status == "ok" and result is None:
        status = "failed (no result.json)"
    return {
        "status": status,
        "rc": rc,
        "wall_s": wall,
        "argv": [f"tools/bench/{_script(name)}.py", *argv],
        "dir": str(bench_dir),
        "log": str(log),
        "stdout_tail": _tail(log),
        "result": result,
    }


def machine_info() -> dict[str, Any]:
    from importlib import metadata

    import torch

    from moerl import device as moerl_device

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                 timeout=30)  # fmt: skip
            return run.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    device = moerl_device.name()
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "megatron_core": version("megatron-core"),
        "triton": version("triton"),
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD") or None,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "loadavg_before": round(os.getloadavg()[0], 2),
    }


def _headline(name: str, result: dict[str, Any] | None) -> str:
    report = _load("report")
    rows = report.headlines({"benches": {name: {"status": "ok", "result": result}}})
    return "; ".join(f"{r.metric}: {r.ours}" for r in rows if r.bench == name)


def render(results: dict[str, Any], out: Path, readme: Path | None = None) -> None:
    """Plots, REPORT.md and (with ``readme``) the README section, from ``results``."""
    report = _load("report")
    results["plots"] = report.write_plots(results, out / "plots")
    (out / "results.json").write_text(json.dumps(_clean(results), indent=1) + "\n")
    (out / "REPORT.md").write_text(report.report_markdown(results, "plots"))
    if readme is not None:
        link = os.path.relpath((out / "plots").resolve(), readme.resolve().parent)
        new = report.replace_section(readme.read_text(), report.readme_section(results, link))
        if new is None:
            print(f"{readme}: no {' / '.join(report.MARKERS)} markers; left unchanged", flush=True)
        else:
            readme.write_text(new)
            print(f"{readme}: results section replaced", flush=True)


def readme_section(results: dict[str, Any], link_root: str = "bench/plots") -> str:
    """The markdown "Results" section for README.md (see ``report.readme_section``)."""
    return _load("report").readme_section(results, link_root)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="each bench's --quick (< 15 min)")
    size.add_argument("--smoke", action="store_true", help="the smallest settings (tests)")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {list(SUITE)}")
    parser.add_argument("--out", type=Path, default=Path("bench"), help="results directory")
    parser.add_argument("--timeout-s", type=int, default=None, help="per bench (default: own)")
    parser.add_argument("--readme", type=Path, default=None, help="replace its results section")
    parser.add_argument("--render-only", action="store_true",
                        help="re-render OUT/results.json; run nothing")  # fmt: skip
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep OUT/results.json's other benches: the benches run replace their records, "
        "each marked with its own commit, date and mode",
    )
    args = parser.parse_args(argv)
    if args.render_only:
        results = json.loads((args.out / "results.json").read_text())
        render(results, args.out, args.readme)
        return results
    names = list(SUITE) if args.only is None else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in SUITE]
    if unknown or not names:
        parser.error(f"--only {args.only!r}: unknown {unknown}; choose from {', '.join(SUITE)}")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"mode": mode, "machine": machine_info(), "benches": {}}
    earlier = args.out / "results.json"
    if args.merge and earlier.is_file():  # the page keeps its machine line, says what is newer
        results = json.loads(earlier.read_text())
        machine = machine_info()
        stamp = {"git_commit": machine["git_commit"], "git_dirty": machine["git_dirty"],
                 "date": machine["date"], "mode": mode}  # fmt: skip
    print(f"mode={mode} out={args.out} benches={','.join(names)} "
          f"device={results['machine']['device']}", flush=True)  # fmt: skip
    start = time.perf_counter()
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}: start", flush=True)
        record = run_bench(name, mode, args.out, args.timeout_s)
        if args.merge:
            record["measured"] = stamp
        results["benches"][name] = record
        done = f"[{i}/{len(names)}] {name}: {record['status']} in {record['wall_s']:.0f}s"
        if record["status"] == "ok":
            done += f" — {_headline(name, record['result'])}"
        else:
            done += f" (see {record['log']})"
        print(done, flush=True)
        # written after every bench, so an interrupted suite keeps what it measured
        (args.out / "results.json").write_text(json.dumps(_clean(results), indent=1) + "\n")
    if not args.merge:
        results["wall_s"] = time.perf_counter() - start
        results["machine"]["loadavg_after"] = round(os.getloadavg()[0], 2)
    render(results, args.out, args.readme)
    report = _load("report")
    print(f"suite wall_s={time.perf_counter() - start:.0f}", flush=True)
    for row in report.headlines(results):
        if row.bench in names:
            print(f"{row.bench}: {row.metric}: {row.ours} (target {row.target}; {row.status})",
                  flush=True)  # fmt: skip
    print(f"wrote {args.out / 'results.json'}, {args.out / 'REPORT.md'}, "
          f"{len(results['plots'])} plots in {args.out / 'plots'}", flush=True)  # fmt: skip
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        _child(sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
    else:
        main()
