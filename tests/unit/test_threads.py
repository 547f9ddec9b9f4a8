"""The core split between trainer ranks and embedded engines (moerl/config/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moerl.config.buffer import StalenessConfig
from moerl.config.schema import MoerlConfig
from moerl.config.threads import (
    MALLOC_ENV,
    keep_freed_memory,
    overlapped,
    resolve_threads,
    set_omp_spincount,
    split_cores,
    usable_cores,
)


@pytest.mark.parametrize(
    ("cores", "ranks", "engines", "overlap", "trainer", "engine"),
    [
        # a laptop, synchronous: the trainer has both cores while it trains; the engine
        # one, the other taking its answers and scoring them
        (2, 1, 1, False, 2, 1),
        (8, 1, 1, False, 8, 7),
        (2, 1, 1, True, 1, 1),  # asynchronous: one core each, never three threads on two
        (8, 2, 1, True, 2, 4),  # half to the engine, the rest split over the ranks
        (8, 1, 2, True, 4, 2),
        (16, 4, 2, False, 4, 7),
        (1, 1, 1, True, 1, 1),  # at least one thread each, even oversubscribed
        (4, 1, 0, True, 4, 1),  # no embedded engine (SGLang servers): all to the trainer
    ],
)
def test_split_cores(cores, ranks, engines, overlap, trainer, engine):
    split = split_cores(cores, ranks, engines, overlap)
    assert (split.trainer, split.engine) == (trainer, engine)
    if overlap and engines and cores >= ranks + engines:
        assert split.trainer * ranks + split.engine * engines <= cores


def test_overlap_follows_the_staleness_policy():
    assert not overlapped(StalenessConfig(max_staleness=0))  # staleness=sync
    assert overlapped(StalenessConfig(max_staleness=1))
    assert overlapped(StalenessConfig(max_staleness=0, throttle=False))  # drop: runs freely


def test_user_settings_win_and_the_rest_follows_the_rule(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = MoerlConfig()
    cfg.staleness.max_staleness = 1
    split = resolve_threads(cfg, world_size=1, has_cuda=False)
    expected = split_cores(usable_cores(), 1, 1, True)
    assert (split.trainer, split.engine) == (expected.trainer, expected.engine)
    cfg.engine.threads = 3
    split = resolve_threads(cfg, world_size=1, has_cuda=False)
    assert split.engine == 3 and split.trainer == expected.trainer
    cfg.launcher.threads = 5
    assert resolve_threads(cfg, world_size=1, has_cuda=False).rule == "set"
    assert resolve_threads(cfg, world_size=1, has_cuda=False).trainer == 5


def test_a_colocated_engine_shares_rank_zeros_threads(monkeypatch):
    """launcher.placement=colocated on CPU: no cores set aside for an engine process,
    whatever the schedule, and one thread for the engine's scheduler (a second OpenMP team
    in the process stops libgomp's threads from waiting for work); user settings still win."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = MoerlConfig()
    cfg.launcher.placement = "colocated"
    for staleness in (0, 1):
        cfg.staleness.max_staleness = staleness
        split = resolve_threads(cfg, world_size=1, has_cuda=False)
        assert (split.trainer, split.engine, split.rule) == (usable_cores(), 1, "colocated")
    cfg.launcher.threads, cfg.engine.threads = 1, 2
    split = resolve_threads(cfg, world_size=1, has_cuda=False)
    assert (split.trainer, split.engine) == (1, 2)


def test_omp_num_threads_caps_every_process_share(monkeypatch):
    """Issue 31: the split ignored OMP_NUM_THREADS=1 and gave each process 2 threads."""
    cfg = MoerlConfig()
    cfg.staleness.max_staleness = 0  # alternating: each side would take every core
    monkeypatch.setattr("moerl.config.threads.usable_cores", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    split = resolve_threads(cfg, world_size=1, has_cuda=False)
    assert (split.trainer, split.engine, split.omp_cap) == (2, 2, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "16")  # above every share: nothing to cap
    assert resolve_threads(cfg, world_size=1, has_cuda=False).omp_cap is None
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a count: ignored
    assert resolve_threads(cfg, world_size=1, has_cuda=False).trainer == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg.launcher.threads = 3  # the user's launcher.threads still wins
    split = resolve_threads(cfg, world_size=1, has_cuda=False)
    assert (split.trainer, split.engine) == (3, 1)


def test_the_colocated_engine_sleeps_by_default_only_with_cuda():
    """launcher.sleep_engine=None: on with CUDA for colocated + sync; never when
    generation overlaps training or the engine has its own process."""
    from moerl.loop import _sleep_tags, engines_sleep

    cfg = MoerlConfig()
    cfg.staleness.max_staleness = 0
    assert not engines_sleep(cfg, has_cuda=True)  # disaggregated
    cfg.launcher.placement = "colocated"
    assert engines_sleep(cfg, has_cuda=True) and not engines_sleep(cfg, has_cuda=False)
    cfg.launcher.sleep_engine = True
    assert engines_sleep(cfg, has_cuda=False)
    cfg.staleness.max_staleness = 1  # async: the engine is busy while the trainer steps
    assert not engines_sleep(cfg, has_cuda=True)
    # weights only when a full-weight push refills them
    assert _sleep_tags(push=True, full_weights=True) == ["kv_cache", "weights"]
    assert _sleep_tags(push=True, full_weights=False) == ["kv_cache"]
    assert _sleep_tags(push=False, full_weights=True) == ["kv_cache"]


@pytest.mark.parametrize(
    ("environ", "spincount", "after"),
    [
        ({}, 50000, "50000"),
        ({}, 0, "0"),
        ({"GOMP_SPINCOUNT": "7"}, 50000, "7"),  # the user's environment wins
        ({"OMP_WAIT_POLICY": "active"}, 50000, None),  # it says how threads wait already
        ({}, None, None),  # launcher.omp_spincount=null: libgomp's default
        ({}, -1, None),  # left for the preflight to refuse
        ({}, "50000", None),
        ({}, True, None),
    ],
)
def test_omp_spincount_is_set_unless_the_environment_chooses(environ, spincount, after):
    env = dict(environ)
    assert set_omp_spincount(spincount, env) == (
        after is not None and "GOMP_SPINCOUNT" not in environ
    )
    assert env.get("GOMP_SPINCOUNT") == after
    assert env.get("OMP_WAIT_POLICY") == environ.get("OMP_WAIT_POLICY")


_FAULTS = """
import resource, sys, threading, torch
from moerl.config.threads import keep_freed_memory
tuned = keep_freed_memory(int(sys.argv[1]))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # two 8 MB tensors and their sum, made and freed as a forward's are
    a, b = torch.ones(2 << 20), torch.ones(2 << 20)
    c = a + b
    del a, b
    return c.sum()
got = []
def work():  # on a thread of its own, as the engine's scheduler (another malloc arena)
    for _ in range(3):  # warm: the first blocks are faulted in either way
        step()
    before = faults()
    for _ in range(20):
        step()
    got.append(faults() - before)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(tuned, got[0])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
def test_keeping_freed_memory_stops_the_page_faults_of_repeated_tensors():
    """launcher.malloc_keep_mb / the engine's --malloc-keep-mb: a thread's step that
    makes and frees three 8 MB tensors faults their pages in again every time with
    glibc's defaults (the thread's arena is trimmed), and hardly once freed memory is
    kept (counted by the kernel: minor page faults; 118176 against 8192 here)."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    runs = {}
    for mb in (0, 256):
        out = subprocess.run(
            [sys.executable, "-c", _FAULTS, str(mb)], env=env, capture_output=True, text=True,
            check=True, timeout=120,
        )  # fmt: skip
        tuned, faults = out.stdout.split()
        runs[mb] = (tuned == "True", int(faults))
    assert runs[0][0] is False and runs[256][0] is True
    assert runs[0][1] > 20 * 4000, runs  # the three tensors' ~6000 pages, every step
    assert runs[256][1] < runs[0][1] / 5, runs


def test_keep_freed_memory_is_skipped_where_the_environment_or_the_value_says():
    environ: dict[str, str] = {"MALLOC_TOP_PAD_": "1"}
    assert not keep_freed_memory(64, environ) and environ == {"MALLOC_TOP_PAD_": "1"}
    for value in (None, 0, -1, True, "64"):
        environ = {}
        assert not keep_freed_memory(value, environ) and environ == {}
