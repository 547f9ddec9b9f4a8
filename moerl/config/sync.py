"""Weight sync from the trainer to the engines (group `sync`)."""

from __future__ import annotations

from dataclasses import dataclass

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
    dtype: str | None = None
    """Cast weights to this dtype before sending (e.g. 'bfloat16' for a bf16 engine);
    None = the trainer's parameter dtype."""
    master_address: str = "127.0.0.1"
    """An address of trainer rank 0 that every engine can reach (a cluster needs the
    node's hostname or IP)."""
    master_port: int | None = None
    """TCP port of the group's store on rank 0; None = a free port."""
    every: int = 1
    """Push weights every this many optimizer steps (1 = after every step)."""
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


def sync_backend(sync: SyncConfig, engine_kind: str, has_cuda: bool) -> str:
    """``sync.backend``, or the default its docstring states."""
    if sync.backend:
        return sync.backend
    return "nccl" if has_cuda and engine_kind == "sglang" else "gloo"
