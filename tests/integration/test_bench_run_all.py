"""tools/bench/run_all.py: the suite runs benches in child processes, survives a bench
that fails, and renders the results page (REPORT.md, plots, README section) from its
results.json.

The rendering tests read a results.json saved from a real `run_all.py --quick` run on a
2-core CPU (tests/fixtures/bench/results_quick_cpu.json), so every bench's row is drawn
from that bench's own result layout."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "bench" / "run_all.py"
SAVED = ROOT / "tests" / "fixtures" / "bench" / "results_quick_cpu.json"
PNG = b"\x89PNG\r\n\x1a\n"


def _module(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        f"test_bench_{name}", ROOT / "tools" / "bench" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG


def _table_benches(report_md: str) -> set[str]:
    rows = [x for x in report_md.split("## Runs")[0].splitlines() if x.startswith("| ")]
    return {x.split("|")[1].strip() for x in rows[1:]}


def _run(tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


@pytest.mark.parametrize(
    "only",
    [
        pytest.param("weight_sync", marks=pytest.mark.slow),  # ~16 s (the 20-minute budget)
        pytest.param("weight_sync,mismatch", marks=pytest.mark.slow),  # ~50 s
    ],
)
def test_run_all_smoke_writes_the_page(tmp_path, only):
    run = _run(tmp_path, "--only", only)
    names = only.split(",")
    for name in names:
        assert f"{name}: start" in run.stdout and f"{name}: ok in" in run.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["mode"] == "smoke"
    for key in ("platform", "cpu_count", "torch", "megatron_core", "device", "date", "git_commit"):
        assert results["machine"][key], key
    for name in names:
        bench = results["benches"][name]
        assert bench["status"] == "ok" and bench["rc"] == 0 and bench["wall_s"] > 0
        assert bench["result"] == json.loads((tmp_path / name / "result.json").read_text())
    report = (tmp_path / "REPORT.md").read_text()
    assert _table_benches(report) == set(_module("report").BENCHES)  # every bench has a row
    assert "## Published anchors" in report and "## GPU" in report
    # the bench's own lines reach its log: per bucket, then the summary
    log = (tmp_path / "weight_sync" / "log.txt").read_text()
    for mb in ("1", "64"):
        assert re.search(rf"^model=tiny bucket_mb={mb} sync_s=[\d.]+$", log, re.M), log[-2000:]
    assert re.search(r"^model=tiny per_tensor_s=[\d.]+ tensors=\d+$", log, re.M)
    assert re.search(
        r"^model=tiny model_mb=[\d.]+ best_bucket_mb=(1|64) bucketed_s=[\d.]+ "
        r"per_tensor_s=[\d.]+ speedup=[\d.]+ tensor_s=[\d.]+ tensor_speedup=[\d.]+$", log, re.M,
    )  # fmt: skip
    for mb in ("1", "64"):  # the same-host tensor path beside the broadcast
        assert re.search(
            rf"^weight_sync transport=tensor model_mb=[\d.]+ bucket_mb={mb} sync_gbps=[\d.]+ "
            r"memcpy_gbps=[\d.]+ frac_of_memcpy=[\d.]+ vs_broadcast=[\d.]+$", log, re.M,
        ), log[-2000:]  # fmt: skip
    assert set(results["benches"]["weight_sync"]["result"]["tiny"]["by_bucket_mb"]) == {"1", "64"}
    expected = {"weight_sync"} | ({"mismatch"} if "mismatch" in names else set())
    assert set(results["plots"]) == expected
    for file in results["plots"].values():
        assert _is_png(tmp_path / "plots" / file), file


def test_a_bench_that_times_out_is_recorded_and_the_suite_goes_on(tmp_path):
    run = _run(tmp_path, "--only", "weight_sync,kernels", "--timeout-s", "1", timeout=120)
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("weight_sync", "kernels"):
        assert results["benches"][name]["status"] == "timeout after 1s", run.stdout
        assert results["benches"][name]["result"] is None
    report = (tmp_path / "REPORT.md").read_text()
    assert report.count("timeout after 1s") >= 2  # in the table and the runs list


def test_report_from_saved_results_covers_every_bench(tmp_path):
    report = _module("report")
    results = json.loads(SAVED.read_text())
    assert set(results["benches"]) == set(report.BENCHES)
    assert all(b["status"] == "ok" for b in results["benches"].values())
    rows = report.headlines(results)
    assert {r.bench for r in rows} == set(report.BENCHES)
    assert not [r for r in rows if r.status.startswith(("error", "failed", "not run"))]
    written = report.write_plots(results, tmp_path / "plots")
    # the timeline PNG is copied from the async bench's output dir, absent here
    scaling = {f"scaling_{s}" for s in ("hidden", "experts", "seq", "topk")}
    drawn = {"reward", "staleness", "mismatch", "weight_sync", "offpolicy", "vs_trl"}
    assert set(written) == drawn | scaling
    for file in written.values():
        assert _is_png(tmp_path / "plots" / file), file
    results["plots"] = written
    page = report.report_markdown(results)
    assert _table_benches(page) == set(report.BENCHES)
    section = report.readme_section(results, "bench/plots")
    assert section.startswith("## Results\n") and "### Published anchors" in section
    # a CPU run's GPU section shows the committed run of tools/gpu/run.py
    assert "bash tools/gpu/run.sh" in section.split("### GPU")[1]
    assert "(bench/plots/mismatch.png)" in section
    assert "## Cost curves (log-log exponents)" in page and "![scaling_seq](plots/" in page
    readme = "intro\n<!-- results:start -->\nOLD-SECTION\n<!-- results:end -->\nrest\n"
    replaced = report.replace_section(readme, section)
    assert replaced is not None and "OLD-SECTION" not in replaced
    assert replaced.endswith("rest\n")
    assert report.replace_section("no markers here", section) is None


def test_gpu_section_is_filled_on_cuda_results():
    report = _module("report")
    results = copy.deepcopy(json.loads(SAVED.read_text()))
    results["machine"]["device"] = "cuda: NVIDIA H100 80GB HBM3"
    kernel = {"kernel": "fused_logprobs", "size": "32768x152064x4096:bfloat16",
              "kernel_ms": 50.0, "torch_ms": 60.0, "speedup": 1.2, "kernel_peak_mb": 100.0,
              "torch_peak_mb": 1000.0, "mem_ratio": 10.0}  # fmt: skip
    results["benches"]["kernels"]["result"] = {"device": "cuda", "rows": [kernel]}
    section = report.readme_section(results)
    gpu = section.split("### GPU")[1]
    assert "Not yet run on a GPU" not in gpu and "NVIDIA H100" in gpu
    assert "| fused_logprobs | 32768x152064x4096:bfloat16 | 50.00 | 60.00 | 1.20 |" in gpu
    row = [r for r in report.headlines(results) if r.bench == "kernels"][0]
    assert row.status == "met"


def test_render_only_rewrites_the_readme_section(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.json").write_text(SAVED.read_text())
    readme = tmp_path / "README.md"
    readme.write_text("# moerl\n<!-- results:start -->\nOLD-SECTION\n<!-- results:end -->\nmore\n")
    _module("run_all").main(
        ["--render-only", "--out", str(tmp_path / "bench"), "--readme", str(readme)]
    )
    text = readme.read_text()
    assert "OLD-SECTION" not in text and text.startswith(
        "# moerl\n<!-- results:start -->\n## Results"
    )
    assert "(bench/plots/weight_sync_buckets.png)" in text and text.endswith("more\n")
    assert (tmp_path / "bench" / "REPORT.md").is_file()
    assert _is_png(tmp_path / "bench" / "plots" / "reward_vs_time.png")


def test_merge_replaces_only_the_benches_run(tmp_path):
    """--merge keeps the other benches' records and says which one is newer, and when."""
    (tmp_path / "results.json").write_text(SAVED.read_text())
    before = json.loads(SAVED.read_text())
    _run(tmp_path, "--only", "kernels", "--merge", "--timeout-s", "1", timeout=120)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["benches"]["kernels"]["status"] == "timeout after 1s"
    assert results["benches"]["kernels"]["measured"]["mode"] == "smoke"
    for name, record in before["benches"].items():
        if name != "kernels":
            assert results["benches"][name] == record, name
    assert results["machine"] == before["machine"]
    line = (tmp_path / "REPORT.md").read_text().split("Machine: ")[1].splitlines()[0]
    assert "; kernels re-measured at commit " in line and "mode smoke" in line


def test_committed_gpu_run_renders_with_its_baselines(tmp_path):
    """bench/gpu/results.json (tools/gpu/run.py on a GPU machine) becomes the GPU section:
    each figure beside its baseline and the status its target gives."""
    report = _module("report")
    runs = json.loads(report.GPU_RUN.read_text())["runs"]
    newest = next(r for r in runs if "vs_trl" in r)  # the colocated job, TRL, the sweep
    run = next(r for r in runs if "part1_pytest_gpu" in r and "part5_main_job" in r)
    with_grouped = next(r for r in runs if "grouped_experts" in r)
    grouped = [r for r in report._gpu_run(with_grouped).splitlines() if r.startswith("| experts |")]
    assert grouped and all("trainer.expert_gemm=grouped" in r and "×)" in r for r in grouped)
    # a run with failed tests says so, and its note follows the header
    failed = dict(run, part1_pytest_gpu={"pytest": "1 failed, 13 passed"}, note="Graphs on.")
    text = report._gpu_run(failed)
    assert "(`bench/gpu/results.json` holds every number and the commands). Graphs on." in text
    assert next(r for r in text.splitlines() if "`pytest -m gpu`" in r).endswith("| not met |")
    said = [(r, r.get("part1_pytest_gpu", {}).get("pytest", "")) for r in runs]
    passing = next(r for r, text in said if "passed" in text and "fail" not in text)
    assert next(
        r for r in report._gpu_run(passing).splitlines() if "`pytest -m gpu`" in r
    ).endswith("| met |")
    run["part2_kernels"] = {
        "lora_gmm@E8": {"kernel_ms": 1.0, "torch_ms": 3.0, "speedup": 3.0,
                        "kernel_peak_mb": 1.0, "torch_peak_mb": 1.0, "mem_ratio": 1.0},
        "fused_logprobs@T": {"kernel_ms": 2.0, "torch_ms": 1.0, "speedup": 0.5,
                             "kernel_peak_mb": 1.0, "torch_peak_mb": 9.0, "mem_ratio": 9.0},
    }  # fmt: skip
    run["part5_main_job"]["reward_mean"] = [0.01, 0.02, 0.2, 0.2, 0.2]
    text = report._gpu_run(run)
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["lora_gmm E8: time; peak memory"].endswith("| ≥ 1× | met |")
    fused = rows["fused_logprobs T: time; peak memory"]  # 0.5× the time, 1/9 the memory
    assert fused.endswith("| memory met, time not |")
    main = [r for k, r in rows.items() if k.startswith("`+recipe=deepseek_moe`")][0]
    assert "0.010 → 0.200" in main and main.endswith("| met |")
    # the newest run: the colocated job, TRL side by side, the chunk sweep, the profile
    newest["vs_trl"]["ratio_sync"], newest["vs_trl"]["ratio_async"] = 0.9, 0.7
    text = report._gpu_runs({"runs": [newest, run]})
    assert text.count("| part | metric |") == 2 and "newest first" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert any("colocated, sync, engine asleep" in r for r in rows)
    trl = [r for r in rows if r.startswith("| vs TRL |")]
    assert len(trl) == 2 and trl[0].endswith("| met |")  # the ratios set above
    assert trl[1].endswith("| not met |")  # colocated as measured
    assert any("chunks 4096x8192" in r for r in rows)
    assert any("kernel launches" in r for r in rows)


def test_gpu_true_on_policy_rows_name_what_failed():
    """The GPU section's issue-30 rows (tools/gpu parts 9 and 10): each setting's
    invariance, the trainer match, and the probe's failing ops, with their status."""
    report = _module("report")
    run = {
        "device": "GPU", "date": "d", "versions": dict.fromkeys(
            ("torch", "triton", "transformers", "megatron-core"), "v"),
        "part9_true_on_policy": {
            "invariant": {"a/float32": ["2/6", "1/6"], "a/bfloat16": ["6/6", "6/6"]},
            "engine_overhead_tiny": {"a/float32": 1.2},
            "trainer": {"a/float32": {"abs_diff_max": 0.0, "exact_tokens": "9/9",
                                      "off_abs_diff_max": 1e-6, "trainer_overhead": 1.5}},
        },
        "part10_probe": {"invariant": "1/2", "differs": {"linear/float32": "257"}},
    }  # fmt: skip
    rows = [r for r in report._gpu_run(run).splitlines() if r.startswith("| true on-policy")]
    status = {r.split(" | ")[1]: r.rstrip(" |").rsplit(" | ", 1)[1] for r in rows}
    assert len(rows) == 6
    assert [v for k, v in status.items() if "batch invariance" in k] == ["not met", "met"]
    assert status["engine time with the mode on / off, a/float32, tiny"] == "met"
    assert status["trainer = engine, single layout, a/float32: max abs diff; exact tokens"] == "met"
    assert status["trainer forward time, batch_invariant / default, a/float32"] == "not met"
    probe = next(r for r in rows if "probe_invariance" in r)
    assert "linear/float32 (257)" in probe and probe.endswith("| not met |")
