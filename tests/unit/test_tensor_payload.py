"""The /update_weights_from_tensor payload (moerl/engine/weights/tensor_payload.py): handles to
another process's shared tensors, SGLang's flattened-bucket metadata read without sglang,
and nothing but tensor data unpickled from the network."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys

import pytest
import torch

from moerl.config.sync import SyncConfig, check_overlap, sync_transport
from moerl.engine.weights.tensor_payload import read_named_tensors, serialize_named_tensors

# A separate process builds SGLang's own FlattenedTensorBucket (as a trainer using SGLang
# would), shares it by file name and prints the dump; it keeps the tensors alive until
# told to exit. sglang is imported there, not here (it patches transformers on import).
SGLANG_SENDER = """
import sys, base64, io, torch, torch.multiprocessing as tmp
from multiprocessing.reduction import ForkingPickler
try:
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
except ImportError:
    print("NO_SGLANG", flush=True); sys.exit(0)
tmp.set_sharing_strategy("file_system")
named = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.tensor([7, 8], dtype=torch.int64)),
         ("c", torch.ones(3, dtype=torch.bfloat16))]
bucket = FlattenedTensorBucket(named_tensors=named)
flat = bucket.get_flattened_tensor().share_memory_()
obj = {"flattened_tensor": flat, "metadata": bucket.get_metadata()}
for meta in (obj["metadata"], [*obj["metadata"][:2], bucket.get_metadata()[2]]):
    obj["metadata"] = meta
    buf = io.BytesIO(); ForkingPickler(buf).dump(obj)
    print(base64.b64encode(buf.getvalue()).decode(), flush=True)
    obj["metadata"][-1].end_idx += 2  # the second dump's last tensor overruns the bucket
sys.stdin.readline()
"""


def _sender(script: str) -> subprocess.Popen[str]:
    """``script`` in another process: it prints its dumps and waits for a line on stdin."""
    return subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_sglangs_own_flattened_bucket_from_another_process_is_read():
    sender = _sender(SGLANG_SENDER)
    try:
        payload, overrun = sender.stdout.readline().strip(), sender.stdout.readline().strip()
        if payload == "NO_SGLANG":
            pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
        named = dict(read_named_tensors([payload], "flattened_bucket"))
        assert torch.equal(named["a"], torch.arange(6.0).view(2, 3))
        assert torch.equal(named["b"], torch.tensor([7, 8])) and named["b"].dtype == torch.int64
        assert named["c"].dtype == torch.bfloat16 and torch.equal(named["c"].float(), torch.ones(3))
        with pytest.raises(ValueError, match="needs a list of \\(name, tensor\\) pairs"):
            read_named_tensors([payload], None)  # a dict where the direct format wants pairs
        with pytest.raises(
            ValueError,
            match=r"metadata\[2\] \(c\): bytes 40:48 do not hold \(3,\) torch.bfloat16 inside the 46-byte bucket",
        ):
            read_named_tensors([overrun], "flattened_bucket")
    finally:
        sender.communicate("done\n", timeout=60)


class _Exploit:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo pwned",))


def test_anything_but_tensor_data_is_refused_before_it_runs():
    dump = base64.b64encode(pickle.dumps([("x", _Exploit())])).decode()
    with pytest.raises(ValueError, match=r"refused to load (posix|os)\.system"):
        read_named_tensors([dump], None)
    with pytest.raises(ValueError, match="not base64"):
        read_named_tensors(["not base64!"], None)
    with pytest.raises(ValueError, match="non-empty list of base64 strings"):
        read_named_tensors([], None)
    with pytest.raises(ValueError, match="load_format='npz'"):
        read_named_tensors([dump], "npz")
    truncated = base64.b64encode(pickle.dumps([("x", 1)])[:-3]).decode()
    with pytest.raises(ValueError, match="could not be read"):
        read_named_tensors([truncated], None)


def test_in_process_handles_give_the_senders_tensors_and_fail_clearly_elsewhere():
    """The colocated engine in the sender's process reads in-process handles: the very
    tensors (no copy, no IPC, which CUDA refuses within one process); another process, or
    this one after the sender let the tensor go, gets an error that says why."""
    base = torch.arange(12.0)
    named = [("w", base[:6].view(2, 3)), ("b", base[6:])]
    dump = serialize_named_tensors(named, in_process=True)
    got = read_named_tensors([dump], None)
    assert [n for n, _ in got] == ["w", "b"]
    assert got[0][1].data_ptr() == base.data_ptr() and got[0][1].shape == (2, 3)
    assert got[1][1].data_ptr() == base[6:].data_ptr()
    reader = "import sys; from moerl.engine.weights.tensor_payload import read_named_tensors as r; r([sys.argv[1]], None)"
    other = subprocess.run([sys.executable, "-c", reader, dump], capture_output=True, text=True)
    assert other.returncode != 0 and "not held by this process" in other.stderr
    lone = serialize_named_tensors([("x", torch.ones(3))], in_process=True)  # nobody keeps x
    with pytest.raises(ValueError, match="launcher.placement=colocated"):
        read_named_tensors([lone], None)


@pytest.mark.parametrize(
    "choice, urls, cuda, mb, want",
    [
        ("auto", ["http://127.0.0.1:30000", "http://localhost:30001"], False, 176, "tensor"),
        ("auto", ["http://127.0.0.1:30000"], False, 1, "broadcast"),  # below tensor_min_mb
        ("auto", ["http://127.0.0.1:30000", "http://node7:30000"], False, 176, "broadcast"),
        ("auto", ["http://127.0.0.1:30000"], True, 176, "broadcast"),
        ("auto", [], False, 176, "broadcast"),
        ("tensor", ["http://node7:30000"], True, 1, "tensor"),
        ("broadcast", ["http://127.0.0.1:30000"], False, 176, "broadcast"),
    ],
)
def test_auto_transport_takes_the_tensor_path_only_on_one_cpu_host(choice, urls, cuda, mb, want):
    assert sync_transport(SyncConfig(transport=choice), urls, cuda, mb) == want


@pytest.mark.parametrize("cuda", [False, True])
def test_a_colocated_engine_always_takes_tensors(cuda):
    """In the trainer's own process there is no network to broadcast over."""
    urls = ["http://colocated-0.moerl.invalid"]
    assert sync_transport(SyncConfig(), urls, cuda, 0.5, colocated=True) == "tensor"


@pytest.mark.parametrize("pp, lora", [(2, False), (1, True)])
def test_overlap_true_where_it_cannot_stage_is_refused_naming_the_fix(pp, lora):
    with pytest.raises(
        ValueError, match="sync.overlap=true needs one pipeline stage.*sync.overlap=false"
    ):
        check_overlap(SyncConfig(overlap=True), pp=pp, lora=lora)
    check_overlap(SyncConfig(overlap=False), pp=pp, lora=lora)
    check_overlap(SyncConfig(overlap=True), pp=1, lora=False)


def test_a_transport_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="sync.transport"):
        SyncConfig(transport="ipc").validate()
    with pytest.raises(ValueError, match="sync.tensor_min_mb"):
        SyncConfig(tensor_min_mb=-1).validate()
    with pytest.raises(ValueError, match="sync.overlap='yes'"):
        SyncConfig(overlap="yes").validate()  # type: ignore[arg-type]


# Another process shares one tensor by file name, prints two dumps of it (each dump is
# read once) and keeps it alive until told to exit.
SHARED_SENDER = """
import sys, torch, torch.multiprocessing as tmp
from moerl.engine.weights.tensor_payload import serialize_named_tensors
tmp.set_sharing_strategy("file_system")
weight = torch.arange(1024.0).share_memory_()
for _ in range(2):
    print(serialize_named_tensors([("w", weight[:512].view(16, 32)), ("v", weight[512:])]),
          flush=True)
sys.stdin.readline()
"""


def test_mapped_storages_keep_a_senders_memory_mapped_between_pushes():
    """The second push of the same shared parameters finds them mapped (no new mapping,
    no page faults); the kept storages are bounded by bytes, least recently used first."""
    import gc

    from moerl.engine.weights.tensor_payload import MappedStorages

    sender = _sender(SHARED_SENDER)
    try:
        first, second = sender.stdout.readline().strip(), sender.stdout.readline().strip()
        mapped = MappedStorages(max_bytes=1 << 20)
        named = dict(read_named_tensors([first], None, mapped))
        assert torch.equal(named["v"], torch.arange(512.0, 1024.0))
        address = named["w"].untyped_storage().data_ptr()
        del named
        gc.collect()
        assert len(mapped) == 1 and mapped.bytes == 4096  # one storage for both views
        again = dict(read_named_tensors([second], None, mapped))
        assert again["w"].untyped_storage().data_ptr() == address
        assert torch.equal(again["w"], torch.arange(512.0).view(16, 32)) and len(mapped) == 1
    finally:
        sender.communicate("done\n", timeout=60)
    small = MappedStorages(max_bytes=2500)
    tensors = [torch.zeros(256).share_memory_() for _ in range(3)]  # 1 KB each
    small.keep([tensors[0], tensors[1], torch.zeros(4)])  # a private tensor is not kept
    small.keep([tensors[0]])  # used again: now the most recent
    small.keep([tensors[2]])
    assert len(small) == 2 and small.bytes == 2048
    kept = {s.data_ptr() for s in small._kept.values()}
    assert kept == {tensors[0].data_ptr(), tensors[2].data_ptr()}
