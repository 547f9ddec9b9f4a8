"""Full-weight sync from a parallel trainer into a running embedded engine.

The trainer (spawned gloo ranks, any layout) loads the tiny DeepSeek checkpoint, scales
every weight by SCALE, and pushes; the engine must then serve exactly what a second
engine started from the scaled HF checkpoint serves. Scaling commutes with every
HF ⇄ Megatron layout change, so the reference checkpoint is written without Megatron.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any
from pathlib import Path

import httpx
import pytest
import torch

from moerl.parallel import spawn

SCALE = 1.01
PROMPT = [5, 17, 3, 99, 42, 8]
BODY = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    "return_logprob": True,
}


def _generate(url: str) -> dict:
    r = httpx.post(f"{url}/generate", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _assert_same(got: dict, want: dict) -> None:
    assert got["output_ids"] == want["output_ids"]
    pairs = zip(
        got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]
    )
    for (lp_a, tok_a, _), (lp_b, tok_b, _) in pairs:
        assert tok_a == tok_b and abs(lp_a - lp_b) < 1e-5, (lp_a, lp_b)


def _max_diff(got: dict, want: dict) -> float:
    a, b = got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]
    return max(abs(x[0] - y[0]) for x, y in zip(a, b))


def _scaled_checkpoint(src: Path, out: Path, scale: float) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v * scale for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def engines(tiny_checkpoints, engine_factory, tmp_path_factory):
    """(engine A on the original weights, engine B on the scaled ones, A's first answer)."""
    src = tiny_checkpoints["deepseek_moe"]
    scaled = _scaled_checkpoint(src, tmp_path_factory.mktemp("scaled") / "hf", SCALE)
    a = engine_factory(src)
    b = engine_factory(scaled)
    return a, b, _generate(a.url)


def _tiny_chunks(layout: str, hf_dir: str | None = None) -> tuple[Any, list[Any]]:
    """In a spawned rank: the tiny DeepSeek config and its model chunks in ``layout``,
    with ``hf_dir``'s weights where given."""
    from moerl.convert import load_hf
    from moerl.models.gpt import build_model
    from moerl.models.tiny import tiny_config
    from moerl.parallel import parse_layout
    from moerl.parallel.state import initialize_for_model

    model = tiny_config("deepseek_moe")
    pcfg, _ = parse_layout(layout)
    initialize_for_model(pcfg, model)
    chunks = build_model(model, pcfg)
    if hf_dir is not None:
        load_hf(chunks, hf_dir, model)
    return model, chunks


def _trainer(
    hf_dir: str,
    url: str,
    layout: str,
    scale: float,
    version: int,
    bucket_mb: float,
    out: str,
    transport: str,
    mode: str = "push",
) -> None:
    from moerl.parallel.full_state import local_shards
    from moerl.sync.weights import WeightSync

    model, chunks = _tiny_chunks(layout, hf_dir)
    with torch.no_grad():
        for shard in local_shards(chunks):
            shard.data.mul_(scale)
    sync = WeightSync(chunks, model, urls=[url], bucket_mb=bucket_mb, transport=transport)
    sync.connect()
    try:
        if mode == "staged":  # gathered now; the parameters change before and while it is sent
            held = sync.stage()
            with torch.no_grad():
                for shard in local_shards(chunks):
                    shard.data.mul_(3.0)
            if held is not None:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    stats = pool.submit(sync.send_staged, held, version).result()
        elif mode == "sent":  # the parameters change as soon as it returns, while it lands
            landing = sync.push_sent(version=version)
            with torch.no_grad():
                for shard in local_shards(chunks):
                    shard.data.mul_(3.0)
            stats = landing.result(timeout=120)
        else:
            stats = sync.push(version=version)
    finally:
        sync.close()
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(stats))


def _push(
    engines,
    tiny_checkpoints,
    tmp_path,
    layout,
    scale,
    version,
    bucket_mb,
    transport="broadcast",
    mode="push",
) -> dict:
    from moerl.parallel import parse_layout

    out = tmp_path / "stats.json"
    hf = str(tiny_checkpoints["deepseek_moe"])
    _, world = parse_layout(layout)
    args = (hf, engines[0].url, layout, scale, version, bucket_mb, str(out), transport, mode)
    spawn(_trainer, world, *args)
    return json.loads(out.read_text())


def _check_pushed(engines, tiny_checkpoints, stats: dict, version: int, scaled: bool) -> None:
    a, b, before = engines
    got = _generate(a.url)
    _assert_same(got, _generate(b.url) if scaled else before)
    if scaled:  # the update really changed what the engine serves
        assert _max_diff(got, before) > 1e-4
    assert got["meta_info"]["weight_version"] == str(version)
    info = httpx.get(f"{a.url}/model_info", timeout=10).json()
    assert info["weight_version"] == str(version)
    hf_bytes = (tiny_checkpoints["deepseek_moe"] / "model.safetensors").stat().st_size
    assert 0.9 * hf_bytes < stats["bytes"] <= hf_bytes  # every tensor once (fp32 as stored)


@pytest.mark.parametrize("layout, buckets", [("pp2", 2), ("tp2ep2", 1)])
def test_push_matches_fresh_engine(engines, tiny_checkpoints, tmp_path, layout, buckets):
    stats = _push(engines, tiny_checkpoints, tmp_path, layout, SCALE, 7, bucket_mb=64)
    _check_pushed(engines, tiny_checkpoints, stats, 7, scaled=True)
    assert stats["buckets"] == buckets  # the tiny model fits one bucket per pipeline stage


def test_small_buckets(engines, tiny_checkpoints, tmp_path):
    """Many buckets (a tensor bigger than a bucket goes alone); pushes the original weights
    back, so the engine serves what it served before any push."""
    stats = _push(engines, tiny_checkpoints, tmp_path, "pp2", 1.0, 8, bucket_mb=0.02)
    _check_pushed(engines, tiny_checkpoints, stats, 8, scaled=False)
    assert stats["buckets"] > 10


@pytest.mark.parametrize(
    "layout, transport",
    [pytest.param("tp2", "broadcast", marks=pytest.mark.slow), ("single", "tensor")],
)
def test_a_staged_push_sends_the_weights_as_they_were_when_gathered(
    engines, tiny_checkpoints, tmp_path, layout, transport
):
    """sync.overlap's push: stage() gathers on every rank (tp2: rank 1 takes part in the
    export's gathers), the parameters are then tripled, and send_staged() on another
    thread of rank 0 still lands the gathered weights, in many held buckets (a lone
    tensor that is a parameter itself, on one rank, copied too), and the version with
    the last; the next push is a plain one."""
    stats = _push(engines, tiny_checkpoints, tmp_path, layout, SCALE, 13, 0.02, transport, "staged")
    _check_pushed(engines, tiny_checkpoints, stats, 13, scaled=True)
    assert stats["buckets"] > 10 and stats.get("borrowed_bytes", 0) == 0
    stats = _push(engines, tiny_checkpoints, tmp_path, layout, 1.0, 14, 64, transport)
    _check_pushed(engines, tiny_checkpoints, stats, 14, scaled=False)


@pytest.mark.parametrize(
    "layout, bucket_mb", [("single", 0.02), pytest.param("tp2", 64, marks=pytest.mark.slow)]
)
def test_a_push_sent_lands_the_weights_that_left_the_wire(
    engines, tiny_checkpoints, tmp_path, layout, bucket_mb
):
    """sync.wait_for_load=false's push: push_sent() returns once the last bucket is off
    the wire, the parameters are tripled at once, and the engine still loads what was
    sent (many buckets, two requests deep, or one; tp2: rank 1 takes part in the
    export), with the version, when the landing completes on the loop; the stats come
    with it. The next push is a plain one."""
    stats = _push(engines, tiny_checkpoints, tmp_path, layout, SCALE, 15, bucket_mb, mode="sent")
    _check_pushed(engines, tiny_checkpoints, stats, 15, scaled=True)
    assert (stats["buckets"] > 10) == (bucket_mb < 1) and stats["seconds"] > 0
    stats = _push(engines, tiny_checkpoints, tmp_path, layout, 1.0, 16, 64)
    _check_pushed(engines, tiny_checkpoints, stats, 16, scaled=False)


def test_a_push_sent_that_the_engine_refuses_fails_in_its_landing(engines, tiny_checkpoints):
    """A bucket the engine refuses after receiving it (a name it does not have): push_sent
    returns, its landing holds the engine's words, the engines' session is closed and the
    group intact, so the next push (the checkpoint's own final norm) goes through."""
    from safetensors.torch import load_file

    from moerl.sync.weights import WeightSync, WeightSyncError

    a, _, _ = engines
    hf = load_file(str(tiny_checkpoints["deepseek_moe"] / "model.safetensors"))
    good = ("model.norm.weight", hf["model.norm.weight"])
    with WeightSync([], None, urls=[a.url], bucket_mb=64) as sync:
        landing = sync.push_sent(5, named=[good, ("model.nope.weight", torch.zeros(2))])
        with pytest.raises(WeightSyncError) as info:
            landing.result(timeout=60)
        assert "model.nope.weight" in str(info.value) and "model unchanged" in str(info.value)
        assert sync.push(6, named=[good])["tensors"] == 1
    assert httpx.get(f"{a.url}/model_info", timeout=10).json()["weight_version"] == "6"


def _stage_two_stages(hf_dir: str, out: str) -> None:
    from moerl.sync.weights import WeightSync, WeightSyncError

    model, chunks = _tiny_chunks("pp2")
    sync = WeightSync(chunks, model, urls=["http://127.0.0.1:9"])
    assert not sync.can_stage()
    with pytest.raises(WeightSyncError, match="one pipeline stage"):
        sync.stage()
    if torch.distributed.get_rank() == 0:
        Path(out).write_text("ok")


def test_a_push_over_two_pipeline_stages_cannot_be_staged(tmp_path):
    """Rank 0 does not hold the other stage's weights: stage() says so on every rank."""
    out = tmp_path / "ok"
    spawn(_stage_two_stages, 2, "unused", str(out))
    assert out.read_text() == "ok"


@pytest.mark.parametrize("layout", ["pp2", pytest.param("tp2ep2", marks=pytest.mark.slow)])
def test_tensor_path_matches_fresh_engine(engines, tiny_checkpoints, tmp_path, layout):
    """sync.transport=tensor (/update_weights_from_tensor, the engine maps rank 0's shared
    buckets): the same weights land as by broadcast; then the original weights go back in
    many small buckets (lone tensors travel in shared copies of their own)."""
    stats = _push(engines, tiny_checkpoints, tmp_path, layout, SCALE, 11, 64, "tensor")
    _check_pushed(engines, tiny_checkpoints, stats, 11, scaled=True)
    if layout == "pp2":  # rank 0's stage: its shared parameters, read where they lie
        assert 0 < stats["borrowed_bytes"] < stats["bytes"]
    stats = _push(engines, tiny_checkpoints, tmp_path, layout, 1.0, 12, 0.02, "tensor")
    _check_pushed(engines, tiny_checkpoints, stats, 12, scaled=False)
    assert stats["buckets"] > 10


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2ep2"])
def test_push_other_layouts(engines, tiny_checkpoints, tmp_path, layout):
    stats = _push(engines, tiny_checkpoints, tmp_path, layout, SCALE, 9, bucket_mb=0.05)
    _check_pushed(engines, tiny_checkpoints, stats, 9, scaled=True)


def test_engine_rejection_surfaces_its_message(engines):
    """Names the engine does not have: its message reaches the trainer, the model and
    version stay as they were, and the group stays usable."""
    from moerl.sync.weights import WeightSync, WeightSyncError

    a, _, _ = engines
    before = _generate(a.url)
    good = ("model.norm.weight", torch.ones(64))
    with WeightSync([], None, urls=[a.url], bucket_mb=64) as sync:
        with pytest.raises(WeightSyncError) as info:
            sync.push(3, named=[good, ("model.nope.weight", torch.zeros(2))])
        assert "model.nope.weight" in str(info.value) and "model unchanged" in str(info.value)
    after = _generate(a.url)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]


def test_engine_without_the_group_fails_without_hanging(engines):
    from moerl.sync.weights import WeightSync, WeightSyncError

    a, _, _ = engines
    sync = WeightSync([], None, urls=[a.url], timeout_s=30)
    sync.connect()
    gone = httpx.post(f"{a.url}/destroy_weights_update_group", json={"group_name": sync.group_name})
    assert gone.json()["success"]
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="no weight-update group"):
        sync.push(4, named=[("model.norm.weight", torch.ones(64))])
    assert time.monotonic() - start < 10
    with pytest.raises(WeightSyncError, match="no weight-update group"):
        sync.close()  # the engine has no group left to destroy: said, not hidden


def test_bucketize_bounds_and_casts():
    from moerl.sync.stream import bucketize

    sizes = [10, 10, 40, 5, 5, 5]  # fp32 elements: 40, 40, 160, 20, 20, 20 bytes
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    out = [(b.names, b.nbytes, last) for b, last in bucketize(named, 100, None)]
    assert out == [(["t0", "t1"], 80, False), (["t2"], 160, False), (["t3", "t4", "t5"], 60, True)]
    half = [(b.names, b.nbytes) for b, _ in bucketize(named, 100, torch.bfloat16)]
    assert half == [(["t0", "t1"], 40), (["t2", "t3", "t4"], 100), (["t5"], 10)]
    assert {d for b, _ in bucketize(named, 100, torch.bfloat16) for d in b.dtypes} == {"bfloat16"}
    assert [(b.names, last) for b, last in bucketize([], 100, None)] == [([], True)]


def test_bucketize_gathers_the_flattened_bucket_bytes_into_two_buffers_in_turn():
    """Each bucket's bytes are SGLang's flattened_bucket (the cast tensors end to end, an
    odd offset included), gathered into the staging buffer not used by the bucket before."""
    from moerl.engine.weights.bucket import flatten
    from moerl.sync.stream import Staging, bucketize

    gen = torch.Generator().manual_seed(0)
    named = [
        ("a", torch.randn(3, generator=gen).bfloat16()),  # 6 bytes: the next starts at 6
        ("b", torch.randn(4, 2, generator=gen).t()),  # not contiguous
        ("c", torch.randn(40, generator=gen)),  # alone: bigger than a bucket
        ("d", torch.randn(5, generator=gen)),
        ("e", torch.arange(6, dtype=torch.int64)),
    ]
    staging = Staging(64)
    seen = []
    for bucket, _ in bucketize(named, 64, None, staging):
        want = flatten([t for n, t in named if n in bucket.names])
        assert torch.equal(bucket.flattened(), want), bucket.names
        seen.append((bucket.names, bucket.flattened().data_ptr()))
    assert [names for names, _ in seen] == [["a", "b"], ["c"], ["d"], ["e"]]
    buffers = [b.data_ptr() for b in staging._buffers]
    assert [ptr for _, ptr in seen] == [buffers[0], named[2][1].data_ptr(), buffers[1], buffers[0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_tensor_finds_nan_and_either_infinity(dtype):
    from moerl.engine.validate import nonfinite_tensor

    fine = [("ok", torch.randn(100).to(dtype)), ("empty", torch.zeros(0, dtype=dtype))]
    assert nonfinite_tensor(fine + [("ints", torch.arange(3))]) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(100).to(dtype)
        t[37] = bad
        assert nonfinite_tensor([*fine, ("bad", t)]) == "bad", bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bucket_of_one_float_dtype_is_checked_in_one_pass(dtype):
    """finite_bucket: True only for an all-finite bucket of one floating dtype; a NaN or
    inf anywhere, several dtypes or integers leave the per-tensor check (which names the
    tensor) to the engine."""
    from moerl.engine.weights.bucket import dtype_name
    from moerl.engine.weights.routes import finite_bucket

    values = torch.randn(300).to(dtype)
    raw = values.view(torch.uint8)
    assert finite_bucket(raw, [dtype_name(dtype)] * 3)
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoiled = values.clone()
        spoiled[299] = bad
        assert not finite_bucket(spoiled.view(torch.uint8), [dtype_name(dtype)] * 3), bad
    assert not finite_bucket(raw, [dtype_name(dtype), "int64"])
    assert not finite_bucket(torch.arange(8, dtype=torch.int64).view(torch.uint8), ["int64"])
    assert not finite_bucket(raw[:-1], [dtype_name(dtype)])  # not a whole number of values


def test_unreachable_engine_fails_fast_and_names_it():
    from moerl.parallel.spawn import free_port
    from moerl.sync.weights import WeightSync, WeightSyncError

    url = f"http://127.0.0.1:{free_port()}"
    sync = WeightSync([], None, urls=[url])
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        sync.connect()
    sync.close()
    assert time.monotonic() - start < 10
    assert url in str(info.value) and "curl" in str(info.value)


def _refused_then_pushed(hf_dir: str, url: str, layout: str, out: str) -> None:
    import contextlib

    import torch.distributed as dist

    from moerl.sync.weights import WeightSync, WeightSyncError

    model, chunks = _tiny_chunks(layout, hf_dir)
    sync = WeightSync(chunks, model, urls=[url], bucket_mb=0.05)
    sync.connect()
    if dist.get_rank() == 0:  # the engine loses the group: it refuses the first bucket
        gone = httpx.post(
            f"{url}/destroy_weights_update_group", json={"group_name": sync.group_name}
        )
        assert gone.json()["success"]
    dist.barrier()
    failed = False
    try:
        sync.push(version=11)
    except WeightSyncError:
        failed = True
    with contextlib.suppress(WeightSyncError):  # rank 0: the engine has no group to destroy
        sync.close()
    seen: list[bool] = [False] * dist.get_world_size()
    dist.all_gather_object(seen, failed)
    again = WeightSync(chunks, model, urls=[url], bucket_mb=0.05)  # as the loop's rejoin
    again.connect()
    try:
        again.push(version=12)
    finally:
        again.close()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(seen))


def test_a_refused_push_fails_on_rank_0_only_and_the_ranks_push_again(
    engines, tiny_checkpoints, tmp_path
):
    """pp2: rank 0 sends the engines every stage's buckets (rank 1's by p2p). When the
    engine refuses the first one, rank 0 still receives and gathers the rest, sent
    nowhere, so rank 1 finishes its part instead of blocking on a send; the error is rank
    0's alone, and all ranks then push again into a new group (moerl/loop.py repeats a
    push this way after an engine restarts)."""
    out = tmp_path / "seen.json"
    hf = str(tiny_checkpoints["deepseek_moe"])
    spawn(_refused_then_pushed, 2, hf, engines[0].url, "pp2", str(out))
    assert json.loads(out.read_text()) == [True, False]
    a, _, before = engines
    got = _generate(a.url)
    assert got["meta_info"]["weight_version"] == "12"
    _assert_same(got, before)  # the original weights, pushed whole the second time


def test_bucketize_borrows_what_the_engines_can_open_where_it_lies():
    """With ``borrow``, accepted tensors that need no cast are not copied: they follow the
    gathered buckets in one bucket of the tensors themselves, which carries is_last."""
    from moerl.sync.stream import bucketize, shared_in_memory

    shared = torch.arange(12.0).share_memory_()
    named = [
        ("a", torch.ones(3)),  # private: gathered
        ("s1", shared[:6].view(2, 3)),  # views of shared memory: borrowed as they are
        ("b", torch.ones(2)),
        ("s2", shared[6:]),
        ("s3", torch.zeros(4, dtype=torch.bfloat16).share_memory_()),
    ]
    out = list(bucketize(named, 1 << 20, None, borrow=shared_in_memory))
    assert [(b.names, b.tensors is not None, last) for b, last in out] == [
        (["a", "b"], False, False),
        (["s1", "s2", "s3"], True, True),
    ]
    borrowed = out[1][0]
    assert [t.data_ptr() for t in borrowed.tensors] == [
        named[1][1].data_ptr(), named[3][1].data_ptr(), named[4][1].data_ptr()
    ]  # fmt: skip
    assert borrowed.nbytes == 6 * 4 + 6 * 4 + 4 * 2 and borrowed.dtypes[2] == "bfloat16"
    # a cast needs a copy, so a shared tensor to be cast is gathered
    cast = list(bucketize(named, 1 << 20, torch.float16, borrow=shared_in_memory))
    assert [(b.names, b.tensors is None) for b, _ in cast] == [(["a", "s1", "b", "s2", "s3"], True)]
    only = list(bucketize(named[1:2], 1 << 20, None, borrow=shared_in_memory))
    assert [(b.names, last) for b, last in only] == [(["s1"], True)]  # no empty bucket first


def test_share_parameters_moves_each_storage_once_and_training_goes_on():
    from moerl.sync.tensor_wire import share_parameters

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].weight = torch.nn.Parameter(
        model[0].weight.detach().view(-1)[:6].view(2, 3)
    )  # one storage
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    moved = share_parameters([model])
    assert moved == sum(
        {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}.values()
    )
    assert all(p.is_shared() for p in model.parameters())
    assert [p is q for p, q in zip(model.parameters(), params)] == [True] * len(params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert model[1].weight.data_ptr() == model[0].weight.data_ptr()  # still one storage
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert not torch.equal(model[0].bias, before[1]) and model[0].bias.is_shared()
    assert share_parameters([model]) == 0  # already there


def test_share_parameters_keeps_them_private_when_dev_shm_is_too_small(monkeypatch, caplog):
    """A full /dev/shm cannot be arranged safely here (a write past it is SIGBUS), so its
    free space is faked; the parameters then stay where they are, with a warning."""
    import moerl.sync.tensor_wire as tensor_wire

    monkeypatch.setattr(tensor_wire, "_shm_free", lambda: 64 * 2**20)
    model = torch.nn.Linear(4, 4)
    with caplog.at_level("WARNING", logger="moerl.sync.tensor_wire"):
        assert tensor_wire.share_parameters([model]) == 0
    assert not model.weight.is_shared() and "--shm-size" in caplog.text


def _pushed_twice(hf_dir: str, url: str, out: str) -> None:
    """The first push records a plan (a world of one), the second replays it after the
    weights changed in place; then a parameter moves to new storage and the third push
    exports again."""
    from moerl.parallel.full_state import local_shards
    from moerl.sync.weights import WeightSync

    model, chunks = _tiny_chunks("single", hf_dir)
    sync = WeightSync(chunks, model, urls=[url], bucket_mb=64, transport="broadcast")
    sync.connect()
    record: dict = {}
    try:
        sync.push(version=20)
        record["planned_after_first"] = sync._plan is not None
        plan = sync._plan
        with torch.no_grad():
            for shard in local_shards(chunks):
                shard.data.mul_(SCALE)
        record["second"] = sync.push(version=21)
        record["replayed"] = sync._plan is plan
        param = next(p for c in chunks for p in c.parameters())
        param.data = param.data.clone()  # new storage: the plan no longer holds
        record["valid_after_move"] = plan.valid()
        sync.push(version=22)
        record["recorded_again"] = sync._plan is not None and sync._plan is not plan
    finally:
        sync.close()
    Path(out).write_text(json.dumps(record))


def test_a_world_of_one_replays_its_push_plan(engines, tiny_checkpoints, tmp_path):
    """moerl/sync/plan.py: the second push copies the parameters by the first's plan and
    the engine serves exactly the scaled checkpoint; a parameter on new storage makes
    the next push export and record again."""
    out = tmp_path / "plan.json"
    spawn(_pushed_twice, 1, str(tiny_checkpoints["deepseek_moe"]), engines[0].url, str(out))
    r = json.loads(out.read_text())
    assert r["planned_after_first"] and r["replayed"], r
    assert not r["valid_after_move"] and r["recorded_again"], r
    _check_pushed(engines, tiny_checkpoints, r["second"], 22, scaled=True)


def _atomic_pushes(hf_dir: str, url: str, out: str) -> None:
    from moerl.sync.publish import FullWeights
    from moerl.sync.weights import WeightSync

    model, chunks = _tiny_chunks("single", hf_dir)
    record = {}
    for n, (name, mb, own) in enumerate((("one", 64, True), ("many", 0.02, True),
                                         ("sglang", 64, False))):  # fmt: skip
        pub = FullWeights(
            lambda mb=mb: WeightSync(chunks, model, urls=[url], bucket_mb=mb), own_engines=own
        )
        try:
            before = pub.atomic_push
            stats = pub.push(version=30 + n).stats
            record[name] = [before, pub.atomic_push, stats["buckets"]]
        finally:
            pub.close()
    Path(out).write_text(json.dumps(record))


def test_a_push_is_atomic_as_one_bucket_to_moerls_own_engines(engines, tiny_checkpoints, tmp_path):
    """``FullWeights.atomic_push`` (what rollout.in_place_pause=auto goes by): unknown,
    so False, before the first push; then True only where the last push was one bucket
    and the engines are moerl's own, which load a bucket between two decode steps."""
    out = tmp_path / "atomic.json"
    spawn(_atomic_pushes, 1, str(tiny_checkpoints["deepseek_moe"]), engines[0].url, str(out))
    r = json.loads(out.read_text())
    assert r["one"] == [False, True, 1], r
    assert r["many"][:2] == [False, False] and r["many"][2] > 1, r
    assert r["sglang"] == [False, False, 1], r


def _session_kept(hf_dir: str, url: str, out: str) -> None:
    import httpx
    import torch

    from moerl.sync.weights import WeightSync, WeightSyncError

    def session_open() -> bool:
        """Whether the engine's session is open: its begin is refused (else closed again)."""
        answer = httpx.post(f"{url}/begin_weight_update", json={}, timeout=30).json()
        if answer.get("success"):
            httpx.post(f"{url}/end_weight_update", json={}, timeout=30)
            return False
        assert "already open" in answer["message"], answer
        return True

    def version() -> str:
        return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])

    model, chunks = _tiny_chunks("single", hf_dir)
    record: dict[str, Any] = {}
    for keep in (True, False):
        sync = WeightSync(chunks, model, urls=[url], keep_session=keep)
        sync.connect()
        try:
            sync.push(version=50)
            pushed = [session_open(), version()]
            sync.push(version=51)
            pushed += [session_open(), version()]
            try:  # a bucket the engine refuses: the push fails and closes the session
                sync.push(version=52, named=[("model.no_such.weight", torch.zeros(4))])
                refused = "pushed"
            except WeightSyncError as err:
                refused = str(err)
            pushed += [session_open(), version()]
            sync.push(version=53)
            pushed += [session_open(), version()]
        finally:
            sync.close()
        record[str(keep)] = {"pushed": pushed, "refused": refused, "closed": session_open()}
    Path(out).write_text(json.dumps(record))


def test_moerls_own_engines_keep_one_weight_session_across_pushes(
    engines, tiny_checkpoints, tmp_path
):
    """``keep_session`` (moerl's own engines): the engine's weight-update session opens
    at the first push and stays open through the next (no begin/end round trips), a
    failed push closes it and the next push opens it again, and ``close()`` closes it.
    Without it (SGLang's servers) every push opens and closes its own."""
    out = tmp_path / "session.json"
    spawn(_session_kept, 1, str(tiny_checkpoints["deepseek_moe"]), engines[0].url, str(out))
    r = json.loads(out.read_text())
    kept, per_push = r["True"], r["False"]
    assert kept["pushed"] == [True, "50", True, "51", False, "51", True, "53"], kept
    assert "model.no_such.weight" in kept["refused"], kept
    assert kept["closed"] is False
    assert per_push["pushed"] == [False, "50", False, "51", False, "51", False, "53"], per_push
    assert per_push["closed"] is False


def _announced_pushes(hf_dir: str, url: str, out: str) -> None:
    """``WeightSync.announce``: refused where it cannot apply; an announced push whose
    engine holds a request that arrived after the announcement; a push of another
    version refused; an announcement that ``close()`` completes."""
    import threading

    from moerl.parallel.full_state import local_shards
    from moerl.sync.weights import WeightSync, WeightSyncError

    def info() -> dict[str, Any]:
        return dict(httpx.get(f"{url}/server_info", timeout=10).json())

    model, chunks = _tiny_chunks("single", hf_dir)
    record: dict[str, Any] = {}
    sglang = WeightSync(chunks, model, urls=[url], keep_session=False)
    sglang.connect()
    try:
        sglang.push(version=60)
        record["sglang_session"] = sglang.announce(61, 0.0)  # its session opens per push
    finally:
        sglang.close()
    sync = WeightSync(chunks, model, urls=[url], keep_session=True, timeout_s=60)
    sync.connect()
    try:
        record["before_any_push"] = sync.announce(61, 0.0)  # no layout known yet
        sync.push(version=61)
        record["too_slow_a_step"] = sync.announce(62, 20.0)  # 4 x 20 s > the 60 s timeout
        with torch.no_grad():
            for shard in local_shards(chunks):
                shard.data.mul_(SCALE)
        waiting = info()["waiting_requests"]
        record["announced"] = sync.announce(62, 0.1)
        record["twice"] = sync.announce(62, 0.1)
        box: dict[str, Any] = {}
        request = threading.Thread(target=lambda: box.setdefault("r", _generate(url)))
        request.start()
        deadline = time.monotonic() + 60
        while info()["waiting_requests"] != waiting + 1:  # it reached the engine and waits
            assert time.monotonic() < deadline, "the request never reached the engine"
        record["held"] = [info()["running_requests"], request.is_alive()]
        try:
            sync.push(version=63)
            record["other_version"] = "pushed"
        except WeightSyncError as err:
            record["other_version"] = str(err)
        record["second"] = sync.push(version=62)
        request.join(60)
        record["held_answer_version"] = box["r"]["meta_info"]["weight_version"]
        record["announced_after_close"] = sync.announce(63, 0.1)
    finally:
        sync.close()
    record["closed_version"] = str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])  # noqa: E501
    Path(out).write_text(json.dumps(record))


def test_an_announced_push_holds_what_arrives_after_it_and_lands_as_a_push(
    engines, tiny_checkpoints, tmp_path
):
    """sync.announce: the push's first request goes before the trainer's step, so the
    engine waits inside its broadcast; a generation request that reaches it then waits
    for the pushed weights and is answered on them (the engine serves exactly the
    scaled checkpoint afterwards); a push of another version is refused without
    breaking the group; ``close()`` completes an announcement no push took. Refused
    (nothing posted) before the first push, for a step too long for the group's
    timeout, twice, and with SGLang's per-push session."""
    out = tmp_path / "announce.json"
    spawn(_announced_pushes, 1, str(tiny_checkpoints["deepseek_moe"]), engines[0].url, str(out))
    r = json.loads(out.read_text())
    assert r["sglang_session"] is False and r["before_any_push"] is False, r
    assert r["too_slow_a_step"] is False and r["twice"] is False, r
    assert r["announced"] is True and r["held"] == [0, True], r
    assert "after announcing version 62" in r["other_version"], r
    assert r["held_answer_version"] == "62", r
    # closing completed the last announcement with the same (scaled) weights
    assert r["announced_after_close"] is True and r["closed_version"] == "63", r
    _check_pushed(engines, tiny_checkpoints, r["second"], 63, scaled=True)
