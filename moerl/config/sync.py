"""Weight sync from the trainer to the engines (group `sync`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from moerl.common.checks import one_of


@dataclass
class SyncConfig:
    """How new weights reach the engines after every optimizer step."""

    bucket_mb: float = 64.0
    """Bucket size in MiB: tensors are flattened into buckets of at most this size and each
    bucket is one broadcast (a larger tensor goes alone)."""
    backend: str | None = None
    """Process-group backend of the trainer→engines group: 'gloo' or 'nccl'; None = nccl with
    CUDA and SGLang servers, gloo otherwise (embedded engines share the trainer's node and,
    by default, its GPU, where NCCL refuses two ranks on one device)."""
    transport: str = "auto"
    """How full weights reach the engines: 'broadcast' (a process group with the engines,
    /update_weights_from_distributed: any host), 'tensor' (SGLang's same-host path,
    /update_weights_from_tensor: the engines map rank 0's buckets from shared memory, no
    bytes on a socket; every engine on rank 0's host) or 'auto' (tensor when every engine
    URL is a loopback address, there is no GPU and the weights reach tensor_min_mb; on CUDA
    the IPC variant has not run on a GPU yet, so auto keeps the broadcast there; always
    with launcher.placement=colocated, where the engine shares the trainer's process)."""
    tensor_min_mb: float = 16.0
    """With transport=auto: the size of the weights (the initial checkpoint's files) from
    which the tensor path is taken. Below it the broadcast is as fast and needs no
    torch_shm_manager helper process (tools/bench/weight_sync.py: tensor/broadcast 0.9× at
    1 MB, 1.6× at 176 MB)."""
    dtype: str | None = None
    """Cast weights to this dtype before sending (e.g. 'bfloat16' for a bf16 engine);
    None = the trainer's parameter dtype. What transformers keeps in float32 for the
    model (DeepSeek-V3's router weights and score bias) is sent uncast: the engine holds
    it in float32, and a cast would round it."""
    master_address: str = "127.0.0.1"
    """An address of trainer rank 0 that every engine can reach (a cluster needs the
    node's hostname or IP)."""
    master_port: int | None = None
    """TCP port of the group's store on rank 0; None = a free port."""
    every: int = 1
    """Push weights every this many optimizer steps (1 = after every step)."""
    overlap: bool = False
    """Send each push while the trainer takes its next step: the weights are gathered
    into buffers held for the push (one copy of them on rank 0, in the sync dtype), the
    trainer goes on, and the next push (or an eval, a checkpoint or the end) first waits
    for it; generation meanwhile goes on with the previous version, as during any async
    push. Needs one pipeline stage and full weights (not LoRA). Off by default: it moves
    the push's work off the trainer's critical path but does not remove it, so it pays
    only where the push would otherwise leave devices idle. On the 2-core CPU recipe
    (async) it made steps slower, 67 -> 75-87 ms: the push competes with the engine for
    the same cores and the engine gets each version later."""
    wait_for_load: bool = True
    """Whether the trainer waits, after each push, for the engines to have loaded it.
    False: the trainer goes on once the last bucket has left its buffers (a broadcast
    push; the tensor path and adapters land first anyway); the engines' loading, the
    weight-update session's end and generation's resumption complete on the rollout
    side's event loop, and the next push (an eval, a checkpoint, the end) first waits
    for them. A failure then surfaces at that wait, handled as the push's own would be
    (an engine restarted meanwhile: the next push repeats it; anything else stops the
    run). The push's metrics come with the next step's line. On by default: on the
    2-core CPU recipe (async) false took the 5-7 ms wait for the engines' answers off
    the trainer's step, but the landing then waited for the interpreter beside the
    trainer's forward pass, generation resumed later, and over 9 alternating pairs of
    runs the step was not faster (README "Weight sync"). It pays where the engines'
    load is long against the trainer's Python work (large models)."""
    adapter_transport: str = "tensors"
    """With LoRA, how each adapter version reaches the engines: 'tensors' (in the request,
    /load_lora_adapter_from_tensors; no shared storage needed) or 'directory' (written as
    a PEFT directory under ``adapter_dir``, loaded with /load_lora_adapter; faster for
    large adapters, but every engine must be able to read that path)."""
    adapter_dir: str | None = None
    """Where 'directory' transport writes adapter versions: a path every engine can read
    (shared filesystem on a cluster); None = ``RUN_DIR/adapters``."""

    def validate(self, key: str = "sync") -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"{key}.bucket_mb={self.bucket_mb} must be positive (64 is typical)")
        if self.backend is not None and self.backend not in ("gloo", "nccl"):
            raise ValueError(f"{key}.backend={self.backend!r}: choose 'gloo', 'nccl' or null")
        if self.every < 1:
            raise ValueError(f"{key}.every={self.every} must be >= 1")
        one_of(f"{key}.adapter_transport", self.adapter_transport, ("tensors", "directory"))
        one_of(f"{key}.transport", self.transport, TRANSPORTS)
        if not self.tensor_min_mb >= 0:
            raise ValueError(f"{key}.tensor_min_mb={self.tensor_min_mb} must be >= 0 (MB)")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"{key}.overlap={self.overlap!r}: choose true or false")
        if not isinstance(self.wait_for_load, bool):
            raise ValueError(f"{key}.wait_for_load={self.wait_for_load!r}: choose true or false")


def check_overlap(sync: SyncConfig, *, pp: int, lora: bool) -> None:
    """sync.overlap=true only where a push can be staged; ValueError naming the fix."""
    if sync.overlap and (pp != 1 or lora):
        raise ValueError(
            f"sync.overlap=true needs one pipeline stage and full weights (parallel.pp={pp}, "
            f"LoRA {'on' if lora else 'off'}): set sync.overlap=false"
        )


def sync_backend(sync: SyncConfig, engine_kind: str, has_cuda: bool) -> str:
    """``sync.backend``, or the default its docstring states."""
    if sync.backend:
        return sync.backend
    return "nccl" if has_cuda and engine_kind == "sglang" else "gloo"


TRANSPORTS = ("auto", "broadcast", "tensor")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def sync_transport(
    sync: SyncConfig,
    engine_urls: Sequence[str],
    has_cuda: bool,
    weights_mb: float,
    colocated: bool = False,
) -> str:
    """``sync.transport``, with 'auto' resolved by the rule its docstring states; an
    engine in the trainer's own process (``colocated``) always takes tensors."""
    if sync.transport != "auto":
        return sync.transport
    if colocated:
        return "tensor"
    hosts = {urlsplit(url).hostname or "" for url in engine_urls}
    same_host = bool(hosts) and all(h in LOOPBACK for h in hosts)
    big = weights_mb >= sync.tensor_min_mb
    return "tensor" if same_host and not has_cuda and big else "broadcast"
