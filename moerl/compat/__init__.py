"""megatron-core on CPU: the compatibility layer moerl owns.

megatron-core assumes CUDA: it asks ``torch.cuda`` for the current device, RNG
states and streams, places a few tensors on ``"cuda"`` by name, and its torch
norms refuse sequence parallelism. ``activate()`` makes all of that work on a
CPU-only machine over gloo, and does nothing when CUDA is available, so GPU
runs use megatron-core untouched. What it changes, each in its own module:

- ``cuda_shim``: ``torch.cuda.current_device/Stream/Event/stream/synchronize``
  and the RNG functions get CPU stand-ins (only functions that raise without
  CUDA; ``torch.cuda.is_available()`` stays False).
- ``device_mode``: a torch function mode that maps ``device="cuda"`` and
  ``Tensor.cuda()`` to the CPU.
- ``rng``: megatron-core's tracker saves/restores the CPU generator.
- ``norm``: ``SequenceParallelTorchNorm``, the local-spec norm that marks its
  weights for the sequence-parallel gradient all-reduce.
- ``megatron_patches``: the remaining megatron-core call sites that cannot work
  on CPU as written (documented one by one there).
- ``moerl.common.triton_hold``: ``import triton`` fails in the process, so
  megatron-core (and torch's compiler, when something imports it) never maps
  libtriton, which cannot run without a GPU (``TRITON_INTERPRET=1`` lets it load).

Call ``activate()`` before building megatron-core models (``moerl.parallel``
does this for you). It is idempotent.
"""

from __future__ import annotations

import torch

from moerl.common import triton_hold
from moerl.compat import cuda_shim, device_mode, rng

__all__ = ["activate", "deactivate", "is_active", "needed", "quiet_megatron"]

_active = False


def needed() -> bool:
    """True when this process has no usable CUDA device."""
    return not torch.cuda.is_available()


def activate(force: bool = False) -> bool:
    """Install the CPU layer if CUDA is absent (or ``force``). Returns whether it is active."""
    global _active
    if _active:
        return True
    if not (needed() or force):
        return False
    if needed():  # before megatron-core loads: it imports Triton (70 MB mapped, unused)
        triton_hold.hold_back()
    quiet_megatron()
    cuda_shim.install()
    rng.install()
    from moerl.compat import megatron_patches

    megatron_patches.install()
    device_mode.enter()
    _disable_dynamo()
    _active = True
    return True


_dynamo_was_disabled: bool | None = None
_eager_was = False


def _disable_dynamo() -> None:
    """megatron-core wraps small fused functions in ``torch.compile`` (``jit_fuser``).
    Under the CPU device mode dynamo traces into the mode's ``__torch_function__`` and
    recompiles on every new call shape until its limit, warning each time; compiled
    code gains nothing on this path, so dynamo is switched off while the layer is on."""
    global _dynamo_was_disabled, _eager_was
    import torch._dynamo

    from moerl.common import deferred_compile

    _dynamo_was_disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    # and the functions moerl deferred never call torch.compile (it imports inductor)
    _eager_was = deferred_compile.set_eager(True)


def deactivate() -> None:
    """Undo ``activate()`` (for tests)."""
    global _active
    if not _active:
        return
    from moerl.compat import megatron_patches

    device_mode.exit_()
    if _dynamo_was_disabled is not None:
        import torch._dynamo

        from moerl.common import deferred_compile

        torch._dynamo.config.disable = _dynamo_was_disabled
        deferred_compile.set_eager(_eager_was)
    megatron_patches.uninstall()
    rng.uninstall()
    cuda_shim.uninstall()
    triton_hold.release()
    _active = False


def is_active() -> bool:
    return _active


def quiet_megatron() -> None:
    """Silence megatron-core's start-up notices that are expected on CPU.

    - "Transformer Engine / Apex is not installed" warnings (we use local specs).
    - the distributed optimizer's own non-leaf ``.grad`` access warning.
    - "CPU RNG state changed within GPU RNG context" from the RNG tracker: on CPU the
      tracker's "CUDA" generator *is* the CPU generator, so the state it forks
      always changes; the fork still restores it correctly.
    """
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # DistributedOptimizer.zero_grad touches .grad of its fp32 shard views; megatron-core
    # marks the line "throws grad-access warning" itself (GPU too).
    warnings.filterwarnings("ignore", message=r".*\.grad attribute of a Tensor that is not a leaf")

    class _DropRngNotice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropRngNotice())
