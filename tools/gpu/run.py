"""The GPU path, run and measured (issue 28): one command on a bare GPU machine.

    python3 tools/gpu/run.py --out DIR [--parts 1 2 3 4 5 6] [--dry-run]

From the repo root, with the wheels of tools/gpu/wheels.txt in ``.whl/``. It installs
them into /tmp/site, exposes the checkout as the ``moerl`` package (below), checks
that every installed wheel's requirements are met, then runs the parts, each in its own
process under its own time limit (``PARTS``), so one hang costs one part:

1. ``pytest -m gpu``: the Triton kernels against their torch twins at GPU sizes;
2. ``tools/bench/kernel_speed.py --device cuda``: fused logprobs, LoRA grouped GEMM, replay
   gather against the torch code they replace (time, peak memory);
3. ``tools/gpu/step_parity.py``: one RL step on CUDA against the same step on the CPU,
   fp32 and bf16, tiny and mid shapes;
4. ``tools/bench/engine.py --device cuda``: the embedded engine against
   ``model.generate`` on CUDA, same weights and prompts, fixed and long-tailed lengths;
5. the main job (``moerl.launch +recipe=deepseek_moe``) with the trainer and its
   embedded engine on the same GPU (``engine.device=auto``): reward curve, s/step, weight-sync seconds from the
   run's metrics.jsonl, peak GPU memory sampled by nvidia-smi;
6. ``tools/bench/run_all.py --quick --only kernels``: the suite's GPU section, the
   kernel rows the report renders for a CUDA machine.

Each part's output goes to ``DIR/partN.log`` as it runs (and to stdout), and is moved to
the end of ``DIR/parts.log`` once the part ends, so a call killed mid-part still returns
the running part's log and DIR never holds more than four files (a GPU call returns at
most 8): ``install.log``, ``parts.log``, the running part's log and ``summary.json``,
which holds every part's status, seconds and parsed results. The last lines printed are
a compact summary.

``--dry-run`` runs the same drivers on the CPU at tiny sizes, without installing
anything (the checkout's environment already has moerl): the test suite runs it, so the
script cannot rot unseen.

Why package links: setup.py installs kernels/, conf/ and recipes/ as moerl.kernels,
moerl.conf and moerl.recipes, so a plain PYTHONPATH of the checkout lacks them, and any
copy of the package elsewhere is shadowed by the checkout's own moerl/ whenever the
working directory is the repo root (``python -m`` puts it first on sys.path). So the
checkout itself gets them: symbolic links moerl/kernels -> ../kernels (and conf,
recipes), git-ignored, made for the run and removed after it. No build step, and
``import moerl.kernels`` works from any directory with the repo on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import PARTS, Part, parse_results  # noqa: E402

SITE = Path("/tmp/site")
# setup.py's package_dir: moerl.<name> is the checkout's <folder>
MAPPED = {"kernels": "kernels", "conf": "conf", "recipes": "recipes"}


def link_package(repo: Path) -> list[Path]:
    """Link ``repo/moerl/<name>`` to ``../<folder>`` for each mapped folder not already
    there; returns the links made (for ``unlink_package``)."""
    made = []
    for name, folder in MAPPED.items():
        link = repo / "moerl" / name
        if not link.exists() and not link.is_symlink():
            link.symlink_to(Path("..") / folder, target_is_directory=True)
            made.append(link)
    return made


def unlink_package(links: list[Path]) -> None:
    for link in links:
        if link.is_symlink():
            link.unlink()


def _stream(argv: list[str], env: dict[str, str], log: Path, limit_s: float) -> tuple[int, float]:
    """Run ``argv`` in its own process group, copying its output to ``log`` and stdout as
    it comes; kill the group after ``limit_s``. Returns (exit status, seconds); 124 on
    timeout, as timeout(1) does."""
    start = time.monotonic()
    with log.open("ab") as sink:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        timed_out = False
        while True:
            chunk = proc.stdout.read()
            if chunk:
                sink.write(chunk)
                sink.flush()
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if proc.poll() is not None and not chunk:
                break
            if time.monotonic() - start > limit_s:
                timed_out = True
                os.killpg(proc.pid, 9)
                proc.wait()
                break
            time.sleep(0.2)
        if timed_out:
            sink.write(f"\n[run.py] killed after {limit_s:.0f} s\n".encode())
    return (124 if timed_out else proc.returncode), time.monotonic() - start


def install(out: Path) -> dict[str, str]:
    """Install .whl/*.whl into SITE and check their requirements; the environment every
    part runs in (the package links are made by ``main``)."""
    log = out / "install.log"
    wheels = sorted(str(p) for p in (REPO / ".whl").glob("*.whl"))
    if not wheels:
        raise SystemExit("no wheels in .whl/: run tools/gpu/fetch_wheels.sh and carry .whl")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels]  # fmt: skip
    rc, _ = _stream(pip, env, log, 120)
    if rc:
        raise SystemExit(f"pip install of .whl failed ({rc}); see {log}")
    path = [str(SITE), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    check = [sys.executable, str(REPO / "tools/gpu/check_env.py"), str(SITE)]
    rc, _ = _stream(check, env, log, 60)
    if rc:
        raise SystemExit(f"the installed wheels miss requirements ({rc}); see {log}")
    return env


def run_part(part: Part, env: dict[str, str], out: Path, work: Path, dry: bool) -> dict:
    log = out / f"part{part.number}.log"
    log.write_text(f"# part {part.number}: {part.name}\n")
    if part.skip:
        log.unlink()
        with (out / "parts.log").open("a") as done:
            done.write(f"# part {part.number}: {part.name}: skipped: {part.skip}\n")
        return {"status": "skipped", "why": part.skip}
    argv = part.argv(work, dry)
    limit = part.dry_limit_s if dry else part.limit_s
    with log.open("a") as f:
        f.write(f"$ {' '.join(argv)}\n")
    sampler = None
    if part.sample_gpu_memory and not dry:  # whole-device peak, trainer and engine together
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 "-lms", "500", "-f", str(work / "gpu_mem.csv")]  # fmt: skip
        sampler = subprocess.Popen(query, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rc, seconds = _stream(argv, env, log, limit)
    finally:
        if sampler is not None:
            sampler.terminate()
            sampler.wait()
    status = "ok" if rc == 0 else ("timeout" if rc == 124 else f"failed rc={rc}")
    result = {"status": status, "seconds": round(seconds, 1), "limit_s": limit}
    try:
        result["results"] = parse_results(part.number, work, log)
    except Exception as err:  # a failed part may leave nothing to parse
        result["results"] = {"parse_error": repr(err)}
    with (out / "parts.log").open("a") as done:
        done.write(log.read_text(errors="replace") + "\n")
    log.unlink()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "outputs/gpu")))
    parser.add_argument("--parts", nargs="+", type=int, default=[p.number for p in PARTS])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, no install")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moerl_gpu_work"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parts.log").unlink(missing_ok=True)  # this run's parts only
    if args.work.exists():
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    started = time.monotonic()
    links = [] if args.dry_run else link_package(REPO)
    try:
        return _run(args, started)
    finally:
        unlink_package(links)


def _run(args: argparse.Namespace, started: float) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1") if args.dry_run else install(args.out)
    env["PYTHONWARNINGS"] = "ignore:Transformer Engine and Apex"
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU paths, also on a machine with a GPU
    summary: dict = {"dry_run": args.dry_run, "parts": {}}
    probe = [sys.executable, str(REPO / "tools/gpu/check_env.py"), "--probe"]
    probed = subprocess.run(probe, env=env, cwd=REPO, capture_output=True, text=True)
    summary["env"] = probed.stdout.strip() or probed.stderr.strip()[-500:]
    for part in PARTS:
        if part.number in args.parts:
            print(f"\n=== part {part.number}: {part.name} ===", flush=True)
            summary["parts"][part.number] = {"name": part.name,
                                             **run_part(part, env, args.out, args.work, args.dry_run)}  # fmt: skip
            (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["seconds"] = round(time.monotonic() - started, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print("\n=== summary ===")
    print(summary["env"])
    for number, part in summary["parts"].items():
        line = json.dumps(part.get("results", part.get("why", "")), default=str)
        print(
            f"part {number} {part['name']}: {part['status']} {part.get('seconds', '')}s {line[:1500]}"
        )
    print(f"total {summary['seconds']}s")
    return summary


if __name__ == "__main__":
    summary = main()
    bad = [p for p in summary["parts"].values() if p["status"] not in ("ok", "skipped")]
    sys.exit(1 if bad else 0)
