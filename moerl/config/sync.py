"""Weight sync from the trainer to the engines (group `sync`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from moerl.common.checks import auto_or_bool, one_of


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
    wait_for_load: Any = "auto"
    """Whether the trainer waits, after each push, for the engines to have loaded it.
    False: the trainer goes on once the last bucket has left its buffers (a broadcast
    push; the tensor path and adapters land first anyway); the engines' loading, the
    weight-update session's end and generation's resumption complete on the rollout
    side's event loop, and the next push (an eval, a checkpoint, the end) first waits
    for them. A failure then surfaces at that wait, handled as the push's own would be
    (an engine restarted meanwhile: the next push repeats it; anything else stops the
    run). The push's metrics come with the next step's line. 'auto' (the default,
    ``waits_for_load``): false for a broadcast of full weights where generation runs
    beside training (any staleness but the synchronous loop's), true otherwise: the
    synchronous loop's next batch needs the pushed weights anyway and its requests
    leave once the last bucket is off the wire (``Publisher.early_ready``). On the
    2-core CPU recipe (async) false won 12 of 14 alternating pairs of runs (6 of 6 in
    one sitting: step 43.9 → 40.2 ms, the push's span 7.1 → 3.5 ms; the engines load a
    bucket between two decode steps, so a waiting trainer waited up to a step); in the
    synchronous loop it started the engines' next prefill ~2 ms later than waiting does
    (README "Weight sync")."""
    announce: bool = True
    """In the synchronous loop (generation waits for every push), post each push's first
    bucket request to the engines before the trainer's step rather than after it: the
    engines then wait inside its broadcast, and the step's weights leave as soon as it
    ends (the request's HTTP round and the engines' entry into the receive, 4-5 ms of a
    2-core step, come off the loop's path). Requests that reach the engines meanwhile
    wait for the pushed weights, as during any push; nothing is announced while an
    eval's requests are out, while an engine restarts, with more than one trainer rank,
    or for SGLang servers (their weight-update session opens per push). False: every
    request after the step, as the asynchronous loop always sends them."""
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
        for name in ("overlap", "announce"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{key}.{name}={getattr(self, name)!r}: choose true or false")
        auto_or_bool(f"{key}.wait_for_load", self.wait_for_load)


def waits_for_load(sync: SyncConfig, overlapped: bool, lands_apart: bool) -> bool:
    """``sync.wait_for_load``, with 'auto' resolved: the trainer waits for each push to
    land unless generation runs beside training (``overlapped``; not the synchronous
    loop) and the push can land apart from its sending (``Publisher.lands_apart``: full
    weights by broadcast; the tensor path and adapters land before they return, and
    going on would only move their metrics to the next step's line)."""
    if sync.wait_for_load == "auto":
        return not (overlapped and lands_apart)
    return bool(sync.wait_for_load)


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
