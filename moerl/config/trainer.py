"""Trainer settings: optimisation, precision and checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moerl.common.checks import non_negative_int, one_of

DTYPES = ("fp32", "bf16")
LR_SCHEDULES = ("constant", "linear", "cosine")
OLD_POLICY_PASSES = ("auto", "separate")
EXPERT_GEMMS = ("auto", "grouped", "loop")
CPU_ADAMS = ("fused", "foreach", "for_loop")


@dataclass
class TrainerConfig:
    """How the trainer steps the policy. Each step publishes a new policy version."""

    seed: int = 1234
    """Seed for parameter init, data order and sampling; every rank derives its own from it."""
    lr: float = 1.0e-6
    """Peak learning rate of the optimizer."""
    train_iters: int = 100
    """Optimizer steps to run (policy versions to publish)."""
    minibatches: int = 1
    """Optimizer steps per rollout batch (verl's ppo_mini_batch_size, slime's steps per
    rollout): the batch is split into this many minibatches in order; 1 = one step per
    batch. The ratios of every minibatch are taken against the weights at the start of
    the batch (algo.old_policy=recompute); the policy version bumps once per batch."""
    global_batch_size: int = 8
    """Sequences per rollout batch (per step), summed over all data-parallel ranks."""
    dtype: str = "fp32"
    """Parameter and compute precision: 'fp32' or 'bf16'."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (megatron-core DistributedOptimizer)."""
    checkpoint_dir: str | None = None
    """Where checkpoints are written and read; None = no checkpoints. The launcher's
    default (conf/trainer/default.yaml) is 'auto': ``<run dir>/checkpoints``, so a run
    keeps its trained weights (at the end, with save_every 0); set null to keep none."""
    save_every: int = 0
    """Checkpoint every this many steps (and always after the last); 0 = only at the end."""
    keep_checkpoints: int = 0
    """Checkpoints to keep in checkpoint_dir: after a new one is published, all but the
    newest this many are deleted (never the one ``latest`` points to); 0 = keep all."""
    resume: bool = False
    """Continue from the newest complete checkpoint in checkpoint_dir instead of starting
    fresh; a corrupt newer one is skipped with a warning naming it."""
    replay: Any = "all"
    """Keep Routing policy (moerl.algo.replay): 'all' replays the engine's routes for every
    token, 'recent' only for tokens within recent_window versions of the trainer, 'none'
    routes freshly; or your own, {_target_: mylab.replay.fn, ...options}."""
    recent_window: int = 1
    """With replay='recent': the largest version gap whose routes are still replayed."""
    sampling_mask: bool = True
    """Restrict training logprobs to the sampler's recorded kept set (top-k/top-p/min-p)."""
    lr_schedule: str = "constant"
    """Learning-rate shape after warmup (megatron-core's OptimizerParamScheduler):
    'constant' (stay at lr), 'linear' or 'cosine' (decay from lr to min_lr, reached after
    lr_decay_steps optimizer steps, then held)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr; 0 = none. Megatron's convention
    (init lr 0): the optimizer step taken after n steps runs at lr × n / lr_warmup_steps,
    so the first step runs at lr 0 and step lr_warmup_steps + 1 is the first at lr."""
    min_lr: float = 0.0
    """The floor 'linear' and 'cosine' decay to (unused by 'constant'); at most lr."""
    lr_decay_steps: int = 0
    """Optimizer steps from the start to the end of the decay, warmup included;
    0 = train_iters × minibatches, the run's total optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; megatron-core exempts biases and other 1-D
    parameters (norm weights)."""
    adam_beta1: float = 0.9
    """Adam beta1 (decay of the gradient's running mean)."""
    adam_beta2: float = 0.999
    """Adam beta2 (decay of the squared gradient's running mean)."""
    adam_eps: float = 1.0e-8
    """Adam epsilon."""
    cpu_adam: str = "fused"
    """torch's AdamW implementation for parameters on the CPU (without Transformer Engine
    or Apex, megatron-core steps torch's AdamW, which on the CPU defaults to a Python
    loop over parameters): 'fused' (one kernel over all of them; 0.5 ms against 2.7 ms
    for the tiny model's 130 tensors, results within an ulp of the loop's), 'foreach'
    (bitwise the loop's, 1.8 ms) or 'for_loop'. On CUDA megatron-core's own choice
    stands."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (all parameters on all ranks) to this; 0 disables.
    The logged grad_norm is the norm before clipping."""
    packing: str = "padded"
    """How sequences become rows: 'padded' (one per row, padded to the step's longest) or
    'packed' (first-fit several per row, block-diagonal attention; less padding)."""
    pack_length: int = 0
    """With packing='packed': tokens per row; 0 = the step's longest sequence."""
    max_tokens_per_microbatch: int = 8192
    """Padded tokens per micro-batch on each data-parallel rank (verl's
    ppo_max_token_len_per_gpu, slime's --max-tokens-per-gpu): sequences are grouped
    longest first into as few micro-batches as fit (each padded to its own longest; with
    pipeline parallelism, to the step's longest with one row count for all), every DP rank
    running the same number. A sequence longer than this runs alone. 0 = batch by
    sequences instead, parallel.micro_batch_size per micro-batch."""
    old_policy_pass: str = "auto"
    """Where π_old (algo.old_policy=recompute, or a correction's trainer logprobs) comes
    from. 'auto': from the training forward itself, detached, when the batch takes one
    optimizer step (trainer.minibatches=1) and the correction needs no statistic over the
    whole batch (batch_normalize; a custom correction unless
    correction.batch_statistic=false), else 'separate'. 'separate': one extra forward over
    the batch (no grad) before the update. Both give the same loss and gradients."""
    recompute: str = "none"
    """Activation recompute: 'none', 'full' (every layer) or 'moe' (MoE layers only).
    Keep Routing replays the same routes in the recomputed forward."""
    logprobs_from: str = "auto"
    """Where the trainer's token logprobs come from: 'logits' (the output layer's logits,
    then a logprob pass), 'hidden' (the output layer itself returns logprobs through the
    fused kernel: [tokens × vocab] fp32 logits never exist; on CPU its torch twin), or
    'auto' = 'hidden' on CUDA with Triton, else 'logits'."""
    kernels: str = "auto"
    """Implementation of the RL hot paths in ``moerl.kernels`` (logprobs from logits):
    'auto' = Triton kernels on CUDA tensors when Triton is installed, their torch twins
    otherwise; 'triton' forces the kernels (an error where they cannot run); 'torch'
    forces the twins (debugging)."""
    numerics: str = "default"
    """'batch_invariant': the trainer's forward computes the bits the embedded engine
    computes with engine.deterministic_inference=true (issue 30's true on-policy:
    moerl/trainer/numerics.py), so with Keep Routing and staleness=sync the engine's and
    the trainer's logprobs are equal and the importance ratio is exactly 1, in every
    layout with tensor and expert-tensor sizes of 1 or 2, in fp32 or bf16 (engine.dtype
    the same), with the local (non-TE) layers and the torch logprob path; not with LoRA.
    'default': megatron-core's own numerics."""
    expert_gemm: str = "auto"
    """How the routed experts of a local (non-TE) model compute: 'loop' (megatron-core's
    SequentialMLP, one expert after another), 'grouped' (two grouped GEMMs over all local
    experts, ``moerl.models.grouped_experts``; the same modules and parameters, and on CPU
    bitwise the loop's results), or 'auto' = 'grouped' on CPU, 'loop' on CUDA (where the
    grouped path copies the stacked expert weights every forward)."""

    def check_microbatching(self, micro_batch_size: int) -> None:
        """Refuse a micro-batching setup that cannot mean what it says."""
        n = self.max_tokens_per_microbatch
        non_negative_int("trainer.max_tokens_per_microbatch", n)
        one_of("trainer.old_policy_pass", self.old_policy_pass, OLD_POLICY_PASSES)
        if n and micro_batch_size != 1:
            raise ValueError(
                f"parallel.micro_batch_size={micro_batch_size} has no effect while "
                f"trainer.max_tokens_per_microbatch={n} sizes micro-batches by tokens: set "
                "trainer.max_tokens_per_microbatch=0 to batch by sequences, or drop "
                "parallel.micro_batch_size"
            )
