"""The one validation pass at start-up, before any process group or model exists.

Every error is a ValueError that names the config key, the bad value and a fix, so
a wrong layout fails in a second with a readable line instead of hanging in gloo.

It sits above the packages whose registries it consults (model families, tasks, buffer
policies, LoRA targets, the objective's slots), beside the check harnesses; `moerl.config`
holds only the schemas and their own range checks.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from moerl.algo.check import check_algo_config
from moerl.common.checks import (
    at_least,
    auto_or_bool,
    check_device_name,
    finite,
    non_negative_int,
    one_of,
    positive_int,
    positive_int_or_off,
    positive_seconds,
)
from moerl.config.engine import ENGINE_DTYPES, ENGINE_KINDS, EngineConfig
from moerl.config.launcher import BACKENDS, PLACEMENTS, LauncherConfig
from moerl.config.model import ModelConfig
from moerl.config.parallel import ParallelConfig
from moerl.config.schema import MoerlConfig
from moerl.config.threads import overlapped
from moerl.config.trainer import CPU_ADAMS, DTYPES, EXPERT_GEMMS, LR_SCHEDULES, TrainerConfig

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
OPTIMIZER_NUMBERS = (
    "lr",
    "min_lr",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "clip_grad",
)


def _check_finite(node: object, prefix: str) -> None:
    """Every float in the config tree is finite: a NaN passes every `<` check and an inf
    lr or temperature fails only once the engines serve NaN weights."""
    for f in dataclasses.fields(node):  # type: ignore[arg-type]
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}={value!r} must be a finite number")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_finite(value, f"{key}.")


def _check_model(m: ModelConfig) -> None:
    from moerl.models.registry import PLAIN, get_family

    if m.family != PLAIN:
        get_family(m.family)  # a registered family or a ModelFamily's import path
    one_of("model.moe_router_score_function", m.moe_router_score_function, ("softmax", "sigmoid"))
    one_of(
        "model.moe_router_load_balancing_type",
        m.moe_router_load_balancing_type,
        ("aux_loss", "seq_aux_loss", "none"),
    )
    one_of(
        "model.moe_token_dispatcher_type", m.moe_token_dispatcher_type, ("alltoall", "allgather")
    )
    if (m.moe_router_num_groups is None) != (m.moe_router_group_topk is None):
        raise ValueError(
            "model.moe_router_num_groups and model.moe_router_group_topk must be set together "
            f"(got {m.moe_router_num_groups} and {m.moe_router_group_topk})"
        )
    if m.first_k_dense_replace and (
        m.num_experts is None or m.first_k_dense_replace >= m.num_layers
    ):
        raise ValueError(
            f"model.first_k_dense_replace={m.first_k_dense_replace} needs an MoE model with more "
            f"than that many layers (num_layers={m.num_layers})"
        )
    for key in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "vocab_size",
        "max_position_embeddings",
        "moe_router_topk",
        "seq_length",
    ):
        positive_int(f"model.{key}", getattr(m, key))
    for key in (
        "num_query_groups",
        "num_experts",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
    ):
        value = getattr(m, key)
        if value is not None:
            positive_int(f"model.{key}", value)
    one_of("model.normalization", m.normalization, NORMALIZATIONS)
    if m.hidden_size % m.num_attention_heads:
        raise ValueError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}; pick a head count that divides the hidden size"
        )
    if m.num_query_groups is not None and m.num_attention_heads % m.num_query_groups:
        raise ValueError(
            f"model.num_query_groups={m.num_query_groups} does not divide "
            f"model.num_attention_heads={m.num_attention_heads}; every KV group must serve "
            "the same number of query heads"
        )
    if m.seq_length > m.max_position_embeddings:
        raise ValueError(
            f"model.seq_length={m.seq_length} exceeds model.max_position_embeddings="
            f"{m.max_position_embeddings}; raise max_position_embeddings or shorten seq_length"
        )
    if m.num_experts is not None and m.moe_router_topk > m.num_experts:
        raise ValueError(
            f"model.moe_router_topk={m.moe_router_topk} exceeds model.num_experts="
            f"{m.num_experts}; a token cannot be routed to more experts than exist, "
            f"choose topk from 1..{m.num_experts}"
        )


def _check_layout(p: ParallelConfig, m: ModelConfig, world_size: int) -> None:
    try:
        p.validate(
            world_size,
            num_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups,
            num_experts=m.num_experts,
        )
    except ValueError as err:
        need = p.pp * math.lcm(p.tp, p.expert_tp * p.ep if m.is_moe else 1)
        if world_size < need:  # e.g. parallel=ep2 on the default one rank
            raise ValueError(
                f"{err}. The layout needs at least {need} ranks and this run has "
                f"{world_size}: add launcher.nproc={need} (one machine) or start it with "
                f"torchrun --nproc-per-node {need}"
            ) from None
        raise
    if m.is_moe and p.tp > 1 and not p.use_sequence_parallel():
        raise ValueError(
            f"parallel.sequence_parallel=false with parallel.tp={p.tp} on an MoE model; "
            "megatron-core needs sequence parallelism for MoE with TP, set it to null or true"
        )
    if p.use_sequence_parallel() and m.seq_length % p.tp:
        raise ValueError(
            f"model.seq_length={m.seq_length} is not divisible by parallel.tp={p.tp}; sequence "
            "parallelism splits every sequence over the TP ranks"
        )
    if m.multi_latent_attention and p.tp > 1:
        _check_mla_tensor_parallel(p.tp)


def _check_mla_tensor_parallel(tp: int) -> None:
    """megatron-core's local MLA (without transformer-engine) trains wrong under TP; the
    trainer refuses it when it wraps the model (moerl.trainer.wrap), after the checkpoint
    is written and the engines are up, so say it here first."""
    from moerl.models.spec import have_transformer_engine

    if not have_transformer_engine():
        raise ValueError(
            f"parallel.tp={tp} with an MLA model (model.multi_latent_attention=true) needs "
            "transformer-engine: megatron-core's local MLA computes wrong gradients under "
            "tensor parallelism; use parallel.tp=1 (scale with parallel.ep, parallel.pp and "
            "parallel.etp) or install moerl[te]"
        )


def _check_numerics(cfg: MoerlConfig) -> None:
    """trainer.numerics=batch_invariant: a layout, dtype and logprob path it matches, and an
    engine in the same dtype."""
    from moerl.trainer.numerics import check

    t, p = cfg.trainer, cfg.parallel
    check(t.numerics, tp=p.tp, etp=p.etp or 1, dtype=t.dtype, family=cfg.model.family)
    if t.numerics != "batch_invariant":
        return
    engine = {"fp32": "float32", "bf16": "bfloat16"}.get(t.dtype)
    if cfg.engine.kind == "embedded" and cfg.engine.dtype != engine:
        raise ValueError(
            f"trainer.numerics=batch_invariant with trainer.dtype={t.dtype!r} and "
            f"engine.dtype={cfg.engine.dtype!r}: the engine computes the trainer's bits in "
            f"the trainer's dtype; set engine.dtype={engine}"
        )
    if cfg.model.normalization != "RMSNorm":
        raise ValueError(
            f"model.normalization={cfg.model.normalization!r} with "
            "trainer.numerics=batch_invariant: only RMSNorm has a batch-invariant version "
            "(kernels/batch_invariant.py); use trainer.numerics=default for this model"
        )
    if t.packing != "padded":
        raise ValueError(
            f"trainer.packing={t.packing!r} with trainer.numerics=batch_invariant: packed rows' "
            "block-diagonal masks take a slower attention whose bits are not the engine's "
            "(kernels/batch_invariant.py attention); use trainer.packing=padded"
        )
    for key, value, fine in (
        ("kernels", t.kernels, ("auto", "torch")),
        ("logprobs_from", t.logprobs_from, ("auto", "logits")),
    ):
        if value not in fine:
            raise ValueError(
                f"trainer.{key}={value!r} with trainer.numerics=batch_invariant: the matching "
                f"numerics compute logprobs from the logits with the torch path; use "
                f"trainer.{key}=auto"
            )


def _check_trainer(t: TrainerConfig, p: ParallelConfig, world_size: int) -> None:
    one_of("trainer.dtype", t.dtype, DTYPES)
    from moerl.algo.replay import check_replay_spec

    check_replay_spec(t.replay, t.recent_window)
    one_of("trainer.kernels", t.kernels, ("auto", "triton", "torch"))
    one_of("trainer.expert_gemm", t.expert_gemm, EXPERT_GEMMS)
    one_of("trainer.cpu_adam", t.cpu_adam, CPU_ADAMS)
    one_of("trainer.logprobs_from", t.logprobs_from, ("auto", "logits", "hidden"))
    if t.recent_window < 0:
        raise ValueError(f"trainer.recent_window={t.recent_window} must be >= 0")
    positive_int("trainer.train_iters", t.train_iters)
    positive_int("trainer.minibatches", t.minibatches)
    t.check_microbatching(p.micro_batch_size)
    _check_optimizer(t)
    positive_int("trainer.global_batch_size", t.global_batch_size)
    per_step = p.micro_batch_size * p.dp(world_size)
    if t.global_batch_size % (per_step * t.minibatches):
        raise ValueError(
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by "
            f"trainer.minibatches × parallel.micro_batch_size × DP = {t.minibatches} × "
            f"{p.micro_batch_size} × {p.dp(world_size)} = {per_step * t.minibatches}; "
            f"use a multiple of {per_step * t.minibatches}"
        )
    if t.resume and (not t.checkpoint_dir or t.checkpoint_dir == AUTO_CHECKPOINTS):
        raise ValueError(
            "trainer.resume=true needs trainer.checkpoint_dir set to the folder to resume from "
            "(the default 'auto' is the new run's own, empty folder: pass the earlier run's "
            "RUN_DIR/checkpoints)"
        )
    _check_checkpointing(t)


AUTO_CHECKPOINTS = "auto"  # trainer.checkpoint_dir: <run dir>/checkpoints


def resolve_checkpoint_dir(t: TrainerConfig, run_dir: str | Path) -> None:
    """``trainer.checkpoint_dir=auto`` (the launcher's default) becomes the run's own
    ``checkpoints`` folder."""
    if t.checkpoint_dir == AUTO_CHECKPOINTS:
        t.checkpoint_dir = str(Path(run_dir) / "checkpoints")


def _check_checkpointing(t: TrainerConfig) -> None:
    non_negative_int("trainer.seed", t.seed)
    non_negative_int("trainer.save_every", t.save_every)
    non_negative_int("trainer.keep_checkpoints", t.keep_checkpoints)
    non_negative_int("trainer.pack_length", t.pack_length)


def _check_optimizer(t: TrainerConfig) -> None:
    """Adam, clipping and the lr schedule (megatron-core asserts these without the key)."""
    for key in OPTIMIZER_NUMBERS:
        finite(f"trainer.{key}", getattr(t, key))
    at_least("trainer.lr", t.lr, 0.0, strict=True)
    at_least("trainer.min_lr", t.min_lr, 0.0)
    if t.min_lr > t.lr:
        raise ValueError(
            f"trainer.min_lr={t.min_lr!r} must be <= trainer.lr={t.lr!r}: the schedule decays "
            "from lr down to min_lr"
        )
    at_least("trainer.weight_decay", t.weight_decay, 0.0)
    for key in ("adam_beta1", "adam_beta2"):
        beta = getattr(t, key)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"trainer.{key}={beta!r} must be in [0, 1)")
    at_least("trainer.adam_eps", t.adam_eps, 0.0, strict=True)
    at_least("trainer.clip_grad", t.clip_grad, 0.0)
    one_of("trainer.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    for key in ("lr_warmup_steps", "lr_decay_steps"):
        value = getattr(t, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"trainer.{key}={value!r} must be an integer >= 0")
    total = t.train_iters * t.minibatches
    decay = t.lr_decay_steps or total
    if t.lr_warmup_steps >= decay:
        source = (
            f"trainer.lr_decay_steps={t.lr_decay_steps}"
            if t.lr_decay_steps
            else f"train_iters × minibatches = {t.train_iters} × {t.minibatches} = {total}"
        )
        raise ValueError(
            f"trainer.lr_warmup_steps={t.lr_warmup_steps} must be smaller than the schedule's "
            f"{decay} optimizer steps ({source}); shorten the warmup"
        )


def _check_engine(e: EngineConfig) -> None:
    one_of("engine.kind", e.kind, ENGINE_KINDS)
    check_device_name("engine.device", e.device)
    if e.num_engines is not None:
        positive_int("engine.num_engines", e.num_engines)
    if e.kind == "sglang":
        if not e.urls:
            raise ValueError(
                "engine.kind=sglang needs engine.urls, the base URLs of running SGLang "
                "servers, e.g. engine.urls=[http://node7:30000]"
            )
        if e.num_engines is not None and e.num_engines != len(e.urls):
            raise ValueError(
                f"engine.num_engines={e.num_engines} but engine.urls lists {len(e.urls)} "
                "servers; set num_engines to null (use every url) or list that many urls"
            )
    elif e.urls:
        raise ValueError(
            f"engine.urls={list(e.urls)} is only read for engine.kind=sglang; the embedded "
            "engines are started by moerl, so leave urls empty or set engine.kind=sglang"
        )


def _check_engine_numbers(e: EngineConfig) -> None:
    one_of("engine.dtype", e.dtype, ENGINE_DTYPES)
    if e.threads is not None:
        positive_int("engine.threads", e.threads)
    for key in (
        "max_running_requests",
        "max_prefill_tokens",
        "max_health_failures",
        "prefix_cache_max_tokens",
    ):
        positive_int(f"engine.{key}", getattr(e, key))
    positive_int_or_off("engine.chunked_prefill_size", e.chunked_prefill_size, "for no chunking")
    if e.cuda_graph_max_bs is not None:
        positive_int("engine.cuda_graph_max_bs", e.cuda_graph_max_bs)
    for key in ("cuda_graph", "deterministic_inference"):
        if not isinstance(getattr(e, key), bool):
            raise ValueError(f"engine.{key}={getattr(e, key)!r} must be true or false")
    auto_or_bool("engine.prefix_cache", e.prefix_cache)
    non_negative_int("engine.max_restarts", e.max_restarts)
    positive_int_or_off(
        "engine.shared_prompt_min_tokens",
        e.shared_prompt_min_tokens,
        "to copy every prompt to each sample (a group reads one copy of a prompt this long)",
    )
    finite("engine.decode_share", e.decode_share)
    if not 0 <= e.decode_share < 1:
        raise ValueError(
            f"engine.decode_share={e.decode_share!r} must be in [0, 1) (the share of an "
            "engine's time its running requests decode while a long prompt prefills)"
        )
    for key in ("admission_wait_ms", "admission_quiet_ms"):
        finite(f"engine.{key}", getattr(e, key))
        at_least(f"engine.{key}", getattr(e, key), 0.0)
    for key in ("startup_timeout_s", "health_interval_s"):
        positive_seconds(f"engine.{key}", getattr(e, key))


def _check_groups(cfg: MoerlConfig, world_size: int) -> None:
    """A step trains on whole groups, and the buffer must hold one step's groups."""
    batch, group = cfg.trainer.global_batch_size, cfg.rollout.group_size
    if batch % group:
        per_step = (
            cfg.trainer.minibatches * cfg.parallel.micro_batch_size * cfg.parallel.dp(world_size)
        )
        raise ValueError(
            f"trainer.global_batch_size={batch} is not a multiple of rollout.group_size="
            f"{group}: a step trains on whole groups; use a multiple of "
            f"{math.lcm(group, per_step)}"
        )
    groups = batch // group
    if cfg.buffer.max_groups < groups:
        raise ValueError(
            f"buffer.max_groups={cfg.buffer.max_groups} is smaller than the {groups} groups a "
            f"step takes (trainer.global_batch_size / rollout.group_size = {batch} / {group}), "
            f"so the trainer would wait forever; set buffer.max_groups >= {groups}"
        )


def _check_launcher(lc: LauncherConfig, world_size: int) -> None:
    if lc.nproc is not None:
        positive_int("launcher.nproc", lc.nproc)
        if lc.nproc != world_size:
            raise ValueError(
                f"launcher.nproc={lc.nproc} but the world size is {world_size}; "
                "drop launcher.nproc or make the two agree"
            )
    if lc.threads is not None:
        positive_int("launcher.threads", lc.threads)
    if lc.omp_spincount is not None:
        non_negative_int("launcher.omp_spincount", lc.omp_spincount)
    if lc.malloc_keep_mb is not None:
        non_negative_int("launcher.malloc_keep_mb", lc.malloc_keep_mb)
    if lc.backend is not None:
        one_of("launcher.backend", lc.backend, BACKENDS)
    one_of("launcher.placement", lc.placement, PLACEMENTS)


def _check_placement(cfg: MoerlConfig) -> None:
    """launcher.placement=colocated: one embedded engine in rank 0, weights by handle."""
    if cfg.launcher.sleep_engine:
        if cfg.launcher.placement != "colocated" or overlapped(cfg.staleness):
            raise ValueError(
                "launcher.sleep_engine=true frees the engine's memory while the trainer "
                "steps, which needs launcher.placement=colocated and a synchronous schedule "
                "(staleness=sync); drop launcher.sleep_engine or set both"
            )
    if cfg.launcher.placement != "colocated":
        return
    if cfg.engine.kind != "embedded":
        raise ValueError(
            "launcher.placement=colocated runs moerl's embedded engine inside trainer rank 0; "
            f"engine={cfg.engine.kind} servers run elsewhere: use launcher.placement="
            "disaggregated with them (SGLang's own colocation is its Engine in your process)"
        )
    if cfg.engine.count() != 1:
        raise ValueError(
            f"launcher.placement=colocated runs one engine inside trainer rank 0, but "
            f"engine.num_engines={cfg.engine.count()}; set engine.num_engines=1 or use "
            "launcher.placement=disaggregated for several engines"
        )
    if cfg.sync.transport == "broadcast":
        raise ValueError(
            "launcher.placement=colocated hands weights to the in-process engine as tensors; "
            "sync.transport=broadcast needs an engine in its own process: set "
            "sync.transport=auto (or tensor), or launcher.placement=disaggregated"
        )


def _check_telemetry_and_sync(cfg: MoerlConfig) -> None:
    at_least("telemetry.progress_interval_s", cfg.telemetry.progress_interval_s, 0.0)
    port = cfg.sync.master_port
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise ValueError(f"sync.master_port={port!r} must be a TCP port in 1..65535, or null")


def _check_rollout(cfg: MoerlConfig) -> None:
    from moerl.rollout.buffer_policies import build_sampling, build_staleness

    cfg.buffer.validate("buffer")
    cfg.staleness.validate("staleness")
    build_staleness(cfg.staleness)
    build_sampling(cfg.buffer.sampling)
    cfg.sync.validate("sync")
    from moerl.config.sync import check_overlap

    check_overlap(cfg.sync, pp=cfg.parallel.pp, lora=cfg.lora.enabled)
    cfg.rollout.validate("rollout")
    if cfg.lora.enabled:
        from moerl.lora import resolve_targets

        cfg.lora.validate("lora")
        resolve_targets(cfg.lora, cfg.model)
        if cfg.rollout.partial_rollout == "abort_resume":
            raise ValueError(
                "rollout.partial_rollout=abort_resume with lora.enabled: a continued request "
                "would mix adapters; use in_place (each request keeps its adapter) or drain"
            )
        if cfg.trainer.numerics == "batch_invariant":
            raise ValueError(
                "trainer.numerics=batch_invariant with lora.enabled: the matching numerics "
                "have no LoRA path yet; set trainer.numerics=default"
            )
        if cfg.engine.deterministic_inference and cfg.engine.kind == "embedded":
            raise ValueError(
                "engine.deterministic_inference=true with lora.enabled: the embedded engine's "
                "batch-invariant mode has no LoRA path yet; set one of them to false"
            )
    from moerl.envs import check_env_config
    from moerl.tasks import check_task_config

    check_task_config(cfg.task)
    check_env_config(cfg.env)
    cfg.telemetry.validate("telemetry")
    _check_eval(cfg)


def _check_eval(cfg: MoerlConfig) -> None:
    """Eval options in range; with eval.every on, every held-out set buildable."""
    cfg.eval.validate("eval")
    if not cfg.eval.enabled:
        return
    if cfg.env.name != "none":
        raise ValueError(
            f"eval.every={cfg.eval.every} with env={cfg.env.name}: evaluation samples single "
            "completions of task prompts, not episodes; set eval.every=0 (eval=none)"
        )
    check_eval_sets(cfg)


def check_eval_sets(cfg: MoerlConfig) -> None:
    """Every held-out set of eval.sets (or the default one) is a buildable task spec
    (`python -m moerl.eval` checks them whatever eval.every)."""
    from moerl.tasks import check_task_config

    for name, spec in cfg.eval.resolve_sets(cfg.task).items():
        try:
            check_task_config(spec)
        except (ValueError, TypeError) as err:
            raise ValueError(f"eval.sets.{name}: {err}") from None


def _check_unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> None:
    """Reject keys that `+key=value` forced past the schema (Hydra allows adding them)."""
    hints = typing.get_type_hints(schema)
    for raw_key in node.keys():
        key = str(raw_key)
        name = prefix + key
        if key not in hints:
            if name == "recipe":
                raise ValueError(
                    f"+recipe={node[key]} names no shipped recipe; list them with "
                    "`python -m moerl.launch --help` (group 'recipe')"
                )
            raise ValueError(
                f"{name} is not a config key; check the spelling against "
                "`python -m moerl.launch --help`"
            )
        child = node[key]
        # The node's own type: a slot typed with a base class (algo.loss) holds a subclass.
        sub = OmegaConf.get_type(child) if isinstance(child, DictConfig) else hints[key]
        if (
            isinstance(child, DictConfig)
            and isinstance(sub, type)
            and dataclasses.is_dataclass(sub)
        ):
            _check_unknown_keys(child, sub, prefix=f"{name}.")


def validate_config(cfg: DictConfig | MoerlConfig, world_size: int | None = None) -> MoerlConfig:
    """Check the whole config for a world of `world_size` trainer ranks.

    `world_size` None = `launcher.world_size()` (launcher.nproc, else WORLD_SIZE, else 1).
    Returns the typed MoerlConfig (a composed DictConfig is converted); raises
    ValueError naming the first bad key.
    """
    if isinstance(cfg, DictConfig):
        _check_unknown_keys(cfg, MoerlConfig)
        obj = OmegaConf.to_object(cfg)
        if not isinstance(obj, MoerlConfig):
            raise TypeError(
                f"expected a config composed from base_config, got {type(obj).__name__}; "
                "call moerl.config.store.register_configs() before composing"
            )
        cfg = obj
    if world_size is None:
        world_size = cfg.launcher.world_size()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size {world_size!r} must be a positive integer")
    _check_finite(cfg, "")
    _check_model(cfg.model)
    _check_layout(cfg.parallel, cfg.model, world_size)
    _check_trainer(cfg.trainer, cfg.parallel, world_size)
    _check_numerics(cfg)
    _check_engine(cfg.engine)
    _check_engine_numbers(cfg.engine)
    _check_launcher(cfg.launcher, world_size)
    _check_placement(cfg)
    check_algo_config(cfg.algo, cfg.correction)
    _check_rollout(cfg)
    _check_groups(cfg, world_size)
    _check_telemetry_and_sync(cfg)
    _check_reward_model(cfg)
    return cfg


def _check_reward_model(cfg: MoerlConfig) -> None:
    """reward_model.*: checked only when enabled (the defaults of a disabled one are fine)."""
    import re

    from moerl.config.reward_model import REWARD_MODEL_KINDS

    rm = cfg.reward_model
    if not rm.enabled:
        return
    one_of("reward_model.kind", rm.kind, REWARD_MODEL_KINDS)
    for key in ("num_engines", "threads", "batch_size", "max_concurrency", "judge_max_new_tokens"):
        positive_int(f"reward_model.{key}", getattr(rm, key))
    non_negative_int("reward_model.max_retries", rm.max_retries)
    positive_seconds("reward_model.timeout_s", rm.timeout_s)
    for key in ("retry_backoff_s", "linger_s"):
        finite(f"reward_model.{key}", getattr(rm, key))
        at_least(f"reward_model.{key}", getattr(rm, key), 0.0)
    finite("reward_model.weight", rm.weight)
    for url in rm.urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"reward_model.urls has {url!r}; give base URLs like 'http://node7:30000'"
            )
    if rm.kind == "prm" and not rm.step_parser and not rm.step_delimiter:
        raise ValueError(
            "reward_model.kind=prm needs reward_model.step_delimiter (e.g. ',') or a "
            "reward_model.step_parser import path to cut responses into steps"
        )
    if rm.kind == "prm" and not rm.step_tag:
        raise ValueError("reward_model.step_tag is empty; the PRM scores the tag after a step")
    if rm.kind == "judge":
        try:
            re.compile(rm.judge_pattern)
        except re.error as err:
            raise ValueError(
                f"reward_model.judge_pattern={rm.judge_pattern!r} is not a regex: {err}"
            ) from None
        for field_name in ("{prompt}", "{response}"):
            if field_name not in rm.judge_template:
                raise ValueError(
                    f"reward_model.judge_template must hold {field_name} "
                    f"(got {rm.judge_template!r})"
                )
    if rm.path or rm.urls:
        return
    from moerl.models.registry import PLAIN

    if cfg.model.family == PLAIN:
        raise ValueError(
            "reward_model.path is empty and model.family has no Hugging Face format to build "
            "a tiny reward model from; set reward_model.path or reward_model.urls"
        )
