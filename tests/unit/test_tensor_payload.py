"""The /update_weights_from_tensor payload (moerl/engine/tensor_payload.py): handles to
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

from moerl.config.sync import SyncConfig, sync_transport
from moerl.engine.tensor_payload import read_named_tensors, serialize_named_tensors

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


def test_sglangs_own_flattened_bucket_from_another_process_is_read():
    sender = subprocess.Popen(
        [sys.executable, "-c", SGLANG_SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
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
    reader = "import sys; from moerl.engine.tensor_payload import read_named_tensors as r; r([sys.argv[1]], None)"
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


def test_a_transport_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="sync.transport"):
        SyncConfig(transport="ipc").validate()
    with pytest.raises(ValueError, match="sync.tensor_min_mb"):
        SyncConfig(tensor_min_mb=-1).validate()
