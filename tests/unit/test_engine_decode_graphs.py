"""Decode steps as captured graphs (``moerl.engine.core.decode_graphs``) against transformers'
own full forward.

On the CPU the step function runs eagerly every time (``run_eagerly``): the same static
shapes as a CUDA graph (rows padded to the captured size, the pool's whole capacity read
and masked, inputs through one buffer), so the padding, masking and slot rules are checked
here; ``pytest -m gpu`` runs the same tests with real CUDA graphs (``moerl.device.graphed``).
"""

# B rows, V vocab, L layers, K top-k

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from engine_slots_for_tests import Owner

from moerl.device import graphed
from moerl.engine.core.decode_graphs import DecodeGraphs, batch_sizes, run_eagerly
from moerl.engine.core.kv_pool import Plan
from moerl.engine.core.model_runner import ModelRunner

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NO_CUDA])]


def capture_for(runner: ModelRunner):  # type: ignore[no-untyped-def]
    if runner.device.type == "cuda":
        return lambda fn: graphed(fn, runner.device)
    return run_eagerly


@pytest.fixture(scope="module", params=[("deepseek_moe", d) for d in DEVICES[:1]] + [
    pytest.param(("qwen3_moe", "cpu")),
    pytest.param(("deepseek_moe", "cuda"), marks=[pytest.mark.gpu, NO_CUDA]),
])  # fmt: skip
def runner(request, tiny_checkpoints):  # type: ignore[no-untyped-def]
    family, device = request.param
    runner = ModelRunner(tiny_checkpoints[family], device=device)
    yield runner
    runner.graphs = None


def full_forward(runner: ModelRunner, tokens: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Logits [V] and routes [L, K] of the last token of one sequence, no cache."""
    with torch.no_grad():
        ids = torch.tensor([tokens], device=runner.device)
        logits = runner.model(input_ids=ids, use_cache=False).logits[0, -1]
    return logits.float(), runner._routes(1, len(tokens))[0, -1]


def decode_and_check(runner, pool, owners, seqs, rng) -> None:  # type: ignore[no-untyped-def]
    new = [int(t) for t in rng.integers(3, 100, len(owners))]
    logits_BV, routes_BLK = runner.decode(pool, [o.slot for o in owners], new)
    assert logits_BV.shape[0] == len(owners) and logits_BV.dtype == torch.float32
    for b, owner in enumerate(owners):
        seqs[b].append(new[b])
        want_logits, want_routes = full_forward(runner, seqs[b])
        torch.testing.assert_close(logits_BV[b], want_logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(routes_BLK[b], want_routes)
        assert pool.length(owner.slot) == len(seqs[b])


def prefilled(runner, lengths, rng, slots=8):  # type: ignore[no-untyped-def]
    """A pool of ``slots`` with one prefilled request per length: (pool, owners, seqs)."""
    pool = runner.new_pool(slots)
    owners = [Owner() for _ in lengths]
    seqs = [rng.integers(3, 100, n).tolist() for n in lengths]
    for o in owners:
        pool.alloc(o)
    runner.extend(pool, [o.slot for o in owners], seqs)
    return pool, owners, seqs


def test_batch_sizes_end_at_the_largest():
    assert batch_sizes(3) == [1, 2, 3]
    assert batch_sizes(64)[-4:] == [40, 48, 56, 64]
    assert batch_sizes(300)[-2:] == [256, 300]
    with pytest.raises(ValueError, match="at least 1"):
        batch_sizes(0)


def test_graphed_decode_equals_the_full_forward(runner):
    """Three rows (padded to four), a fourth joining in the slot the pad row wrote, a
    freed slot refilled by the last one, and a pool that grows past its capacity: every
    step's logits and routes are those of a full forward without cache."""
    rng = np.random.default_rng(0)
    runner.graphs = graphs = DecodeGraphs(runner, max_bs=8, capture=capture_for(runner))
    pool, owners, seqs = prefilled(runner, (5, 19, 11), rng)
    for _ in range(3):
        decode_and_check(runner, pool, owners, seqs, rng)
    assert graphs.replays == 3 and list(graphs.steps) == [4]  # three rows padded to four
    late = Owner()
    pool.alloc(late)  # slot 3: the pad row's, written at position 0 by the steps above
    owners.append(late)
    seqs.append(rng.integers(3, 100, 7).tolist())
    runner.extend(pool, [late.slot], [seqs[-1]])
    decode_and_check(runner, pool, owners, seqs, rng)
    pool.free(owners[0], wipe=True)  # the last slot moves into slot 0
    del owners[0], seqs[0]
    assert [o.slot for o in owners] == [1, 2, 0]
    owners.sort(key=lambda o: o.slot)  # the scheduler decodes in slot order
    seqs = [seqs[[1, 2, 0].index(o.slot)] for o in owners]
    capacity, captures, steps = pool.capacity, graphs.captures, 4
    while pool.capacity == capacity:  # past the capacity: the pool is reallocated
        decode_and_check(runner, pool, owners, seqs, rng)
        steps += 1
    assert graphs.captures == captures + 1  # the three-row graph again, on the new pool
    decode_and_check(runner, pool, owners, seqs, rng)
    assert graphs.replays == steps + 1  # every step replayed a graph
    assert graphs.disabled is None


def test_steps_a_graph_cannot_take_run_eagerly(runner):
    rng = np.random.default_rng(1)
    runner.graphs = graphs = DecodeGraphs(runner, max_bs=2, capture=capture_for(runner))
    pool, owners, seqs = prefilled(runner, (4, 6, 9), rng)
    decode_and_check(runner, pool, owners, seqs, rng)  # three rows: more than max_bs
    decode_and_check(runner, pool, owners[1:2], seqs[1:2], rng)  # slot 1 alone
    assert not graphs.usable(pool, [0, 1, 2], None)
    assert not graphs.usable(pool, [0, 1], None)  # slot 2 is used too
    pool.free(owners[2])
    assert graphs.usable(pool, [0, 1], None)
    assert not graphs.usable(pool, [0, 1], ["adapter", None])
    assert graphs.captures == graphs.replays == 0


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(runner, caplog):
    rng = np.random.default_rng(2)
    tries = []

    def refuse(fn):  # type: ignore[no-untyped-def]
        tries.append(fn)
        raise RuntimeError("operation not permitted when stream is capturing")

    runner.graphs = graphs = DecodeGraphs(runner, max_bs=4, capture=refuse)
    pool, owners, seqs = prefilled(runner, (3, 8), rng, slots=4)
    with caplog.at_level("WARNING", logger="moerl.engine.core.decode_graphs"):
        for _ in range(3):
            decode_and_check(runner, pool, owners, seqs, rng)
    assert len(tries) == 1 and graphs.captures == 0
    assert "not permitted when stream is capturing" in (graphs.disabled or "")
    assert "--disable-cuda-graph" in caplog.text
    assert not graphs.usable(pool, [0, 1], None)
    assert graphs.info()["cuda_graph_disabled_reason"] == graphs.disabled


def test_released_weights_drop_the_graphs(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["deepseek_moe"])
    runner.graphs = graphs = DecodeGraphs(runner, max_bs=4, capture=run_eagerly)
    pool = runner.new_pool(4)
    owner = Owner()
    pool.alloc(owner)
    runner.extend(pool, [0], [[5, 6, 7]])
    runner.decode(pool, [0], [8])
    assert list(graphs.steps) == [1]
    shapes = runner.release_weights()
    assert graphs.steps == {}
    runner.resume_weights(shapes)
    assert graphs.steps == {}


def test_the_engine_flags(tmp_path):
    from moerl.engine.cli import parse_args

    args = parse_args(["--model-path", str(tmp_path)])
    assert not args.enable_cuda_graph and args.cuda_graph_max_bs is None
    args = parse_args(["--model-path", str(tmp_path), "--enable-cuda-graph",
                       "--cuda-graph-max-bs", "16"])  # fmt: skip
    assert args.enable_cuda_graph and args.cuda_graph_max_bs == 16
    assert parse_args(["--model-path", str(tmp_path), "--disable-cuda-graph"]).disable_cuda_graph
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path), "--cuda-graph-max-bs", "0"])


def test_graphs_are_built_on_cuda_only_when_enabled(tiny_checkpoints):
    """On the CPU the engine has no graphs even when asked (there is nothing to capture);
    on CUDA (``pytest -m gpu``) ``--enable-cuda-graph`` gives them, and
    ``--disable-cuda-graph`` wins over it."""
    from moerl.engine.cli import parse_args
    from moerl.engine.launch import build_state

    path = str(tiny_checkpoints["deepseek_moe"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for flags, want in (
        ([], False),
        (["--enable-cuda-graph"], device == "cuda"),
        (["--enable-cuda-graph", "--disable-cuda-graph"], False),
    ):
        args = parse_args(["--model-path", path, "--device", device, *flags])
        runner = build_state(args).state.engine.runner
        assert (runner.graphs is not None) == want, flags
        if want:
            assert runner.graphs.max_bs == 64  # --max-running-requests' default


def test_the_graph_step_runs_graphable_experts_and_prefill_keeps_the_models(runner):
    rng = np.random.default_rng(3)
    runner.graphs = graphs = DecodeGraphs(runner, max_bs=4, capture=capture_for(runner))
    assert graphs.experts == "batched_mm"  # float32: torch's grouped GEMM syncs with the host
    seen = []
    experts = next(m for n, m in runner.model.named_modules() if n.endswith("mlp.experts"))
    hook = experts.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._experts_implementation)
    )
    try:
        own = runner.model.config._experts_implementation
        pool, owners, seqs = prefilled(runner, (3, 6), rng, slots=4)
        prefill, seen[:] = list(seen), []
        decode_and_check(runner, pool, owners, seqs, rng)
    finally:
        hook.remove()
    assert set(prefill) == {own} and "batched_mm" in seen
    assert runner.model.config._experts_implementation == own


@pytest.mark.gpu
@NO_CUDA
def test_a_bfloat16_step_is_captured_with_grouped_experts(tiny_checkpoints):
    runner = ModelRunner(tiny_checkpoints["deepseek_moe"], dtype="bfloat16", device="cuda")
    runner.graphs = graphs = DecodeGraphs(runner, max_bs=8, capture=capture_for(runner))
    assert graphs.experts == "grouped_mm"
    pool = runner.new_pool(8)
    owners = [Owner() for _ in range(5)]
    seqs = [[5 + i, 6, 7, 8 + i] for i in range(5)]
    for o in owners:
        pool.alloc(o)
    runner.extend(pool, [o.slot for o in owners], seqs)
    logits_BV, _ = runner.decode(pool, [o.slot for o in owners], [9] * 5)
    assert graphs.disabled is None and graphs.captures == 1 and graphs.replays == 1
    for b, seq in enumerate(seqs):
        want, _ = full_forward(runner, [*seq, 9])
        torch.testing.assert_close(logits_BV[b], want, rtol=5e-2, atol=5e-2)


def test_a_step_keeps_alive_what_its_graph_reads(tiny_checkpoints):
    """A CUDA graph reads its inputs by address and holds no reference to them: the
    tensors a step made before its capture (the plan's index tensors, the input buffer)
    must be kept by the step, or their memory is reused and a replay reads garbage (an
    H200 run failed so: "index out of bounds" in the first replay). There is no graph on
    the CPU, so the capture here is a stand-in that does what a graph does to references:
    it runs the step once and keeps only its outputs."""
    runner = ModelRunner(tiny_checkpoints["deepseek_moe"])
    refs = []

    def like_a_graph(fn):  # type: ignore[no-untyped-def]
        out = fn()
        cells = [c.cell_contents for c in fn.__closure__ or ()]
        plan = next(c for c in cells if isinstance(c, Plan))
        refs.extend(weakref.ref(t) for t in (plan.index, plan.pos_idx, plan.static_positions))
        return lambda: out

    runner.graphs = DecodeGraphs(runner, max_bs=4, capture=like_a_graph)
    pool = runner.new_pool(4)
    owner = Owner()
    pool.alloc(owner)
    runner.extend(pool, [0], [[5, 6, 7]])
    runner.decode(pool, [0], [8])
    gc.collect()
    assert len(refs) == 3 and all(ref() is not None for ref in refs)


@pytest.mark.gpu
@NO_CUDA
def test_graphed_keeps_its_function_and_what_it_closes_over():
    dev = torch.device("cuda")
    source = torch.arange(100, 104, device=dev)

    def make():  # type: ignore[no-untyped-def]
        index = torch.tensor([3, 2, 1, 0], device=dev)  # made before the capture
        return lambda: source[index]

    fn = make()
    ref = weakref.ref(fn)
    replay = graphed(fn, dev)
    del fn
    gc.collect()
    assert ref() is not None
    torch.cuda.empty_cache()
    junk = torch.full((1 << 20,), 10**6, device=dev)  # would land on a freed index
    assert replay().tolist() == [103, 102, 101, 100]
    del junk
