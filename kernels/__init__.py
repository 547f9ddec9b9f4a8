"""Triton kernels for the RL hot paths, each beside a plain-torch twin; installed as
`moerl.kernels`.

- ``logprob``: per-token logprob (+ entropy) from logits or from hidden states and the
  output layer, vocab-parallel, with temperature and the sampling-mask kept set, never
  materialising fp32 [tokens × vocab] logits.
- ``lora_gmm``: every routed expert's LoRA as one segment GEMM (A products, then B).
- ``replay_gather``: Keep Routing's gather of the replayed experts' scores, renormalised.
- ``batch_invariant``: ops whose result for a row does not depend on the batch (fixed-shape
  products, tree and fold sums), for the engine's deterministic mode; torch ops, with
  their products by ``tile_product`` (torch's on the CPU, one fixed-configuration
  Triton kernel on CUDA).

The twin defines each kernel's semantics, is the test oracle, and is what runs on CPU or
without Triton; ``dispatch`` chooses (``trainer.kernels`` / ``MOERL_KERNELS``).
"""

if __name__ == "kernels":  # this directory imported by its own name, not as moerl.kernels
    # The checkout's root is on sys.path (``python -m`` run in a clone, a script beside
    # it), and the name belongs to an installed distribution: Hugging Face's ``kernels``,
    # which transformers (5.25 on) requires and imports. That one is loaded in this
    # module's place; with none installed this directory stays what ``kernels`` names.
    import sys as _sys
    from importlib import machinery as _machinery
    from importlib import util as _util
    from pathlib import Path as _Path

    _root = _Path(__file__).resolve().parent.parent
    _elsewhere = [p for p in _sys.path if _Path(p or ".").resolve() != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _installed = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _installed
        _spec.loader.exec_module(_installed)
