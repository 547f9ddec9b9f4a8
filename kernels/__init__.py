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
