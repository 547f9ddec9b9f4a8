"""The RL trainer: megatron-core model, optimizer and objective built from config.

``Trainer`` owns one rank's model chunks (with Keep Routing), its DDP wrapper and
optimizer, and the configured advantage estimator, policy loss and IS correction.
``step(trajectories)`` turns rewards into advantages, runs one RL step and publishes the
next policy version; ``save()`` / resume checkpoint everything. The asynchronous loop
(orchestrator, buffer, weight sync) drives it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moerl.algo.replay import check_replay_spec, is_none
from moerl.common.trajectory import Trajectory
from moerl.compat import device_mode
from moerl.config.model import ModelConfig
from moerl.config.parallel import ParallelConfig
from moerl.config.trainer import TrainerConfig
from moerl.device import all_reduce_host
from moerl.kernels.dispatch import set_backend as set_kernel_backend
from moerl.trainer.batch import Advantage
from moerl.trainer.fused_head import resolve_source

REPLAY_POLICIES = ("all", "recent", "none")


class Trainer:
    def __init__(
        self,
        model: ModelConfig,
        parallel: ParallelConfig,
        trainer: TrainerConfig,
        algo: Any,
        correction: Any,
        *,
        hf_dir: str | Path | None = None,
        lora: Any | None = None,
    ) -> None:
        from moerl.algo.advantages import build_advantage
        from moerl.algo.correction import build_correction
        from moerl.algo.losses import build_policy_loss
        from moerl.models.gpt import build_model
        from moerl.models.spec import have_transformer_engine
        from moerl.parallel.state import initialize_for_model
        from moerl.trainer import checkpoint
        from moerl.trainer.schedule import build_scheduler
        from moerl.trainer.wrap import OptimConfig, attach_schedule_hooks, build_optimizer, wrap_ddp

        check_replay_spec(trainer.replay, trainer.recent_window)
        trainer.check_microbatching(parallel.micro_batch_size)
        if trainer.packing == "packed" and have_transformer_engine():
            raise ValueError(
                "trainer.packing=packed relies on a block-diagonal attention mask, which "
                "transformer-engine's causal attention does not take (THD packed_seq_params "
                "are not wired yet); use trainer.packing=padded with transformer-engine"
            )
        self.model, self.cfg, self.hf_dir = model, trainer, hf_dir
        initialize_for_model(parallel, model, seed=trainer.seed)
        # LoRA hooks megatron-core's local linears (and TE's grouped experts, which the
        # local spec does not build): with LoRA the model takes the local spec even where
        # transformer-engine is installed; None = TE when installed
        self.use_te = False if lora is not None and lora.enabled else None
        matching = trainer.numerics == "batch_invariant"
        if matching:  # its ops replace the local layers' (moerl/trainer/numerics.py)
            self.use_te = False
        chunks = build_model(
            model,
            parallel,
            trainer.dtype,
            # replay hooks even with replay='none': they pass the router through, and
            # the flip-rate and mismatch probes record the fresh routes with them
            routing_replay=True,
            per_token_loss=True,
            recompute=trainer.recompute,
            use_te=self.use_te,
            expert_gemm=trainer.expert_gemm,
        )
        if hf_dir is not None:
            from moerl.convert import load_hf

            load_hf(chunks, hf_dir, model)
        self.kl = algo.kl
        self.reference = self._reference(chunks, model, parallel) if algo.kl.coef > 0 else None
        if matching:
            from moerl.trainer import numerics

            numerics.enable(chunks, model.family)
        set_kernel_backend("torch" if matching else trainer.kernels)
        self.logprobs_from = "logits" if matching else resolve_source(trainer.logprobs_from)
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:  # freeze the base; only adapters train (and sync)
            from moerl.lora import apply_lora

            apply_lora(chunks, self.lora, model)
        self.chunks = wrap_ddp(chunks, trainer.use_distributed_optimizer)
        self.optimizer = build_optimizer(
            self.chunks,
            OptimConfig(
                lr=trainer.lr,
                min_lr=trainer.min_lr,
                weight_decay=trainer.weight_decay,
                adam_beta1=trainer.adam_beta1,
                adam_beta2=trainer.adam_beta2,
                adam_eps=trainer.adam_eps,
                clip_grad=trainer.clip_grad,
                use_distributed_optimizer=trainer.use_distributed_optimizer,
                cpu_adam=trainer.cpu_adam,
            ),
        )
        # counts optimizer steps: step it once after every optimizer.step()
        self.scheduler = build_scheduler(self.optimizer, trainer)
        attach_schedule_hooks(self.chunks, self.optimizer)
        self.micro_batch_size = parallel.micro_batch_size
        self.advantage_fn = build_advantage(algo.advantage)
        self.loss_fn = build_policy_loss(algo.loss)
        self.correction_fn = build_correction(correction)
        self.correction_cfg = correction
        self.old_policy = algo.old_policy
        self.credit = getattr(algo, "credit", "outcome")
        self.turn_discount = float(getattr(algo, "turn_discount", 1.0))
        self.decoupled = bool(getattr(algo.loss, "decoupled", False))
        self.agg = getattr(algo.loss, "agg", "token_mean")
        self.version = 0
        self.progress: dict[str, Any] = {}
        if trainer.resume:
            if not trainer.checkpoint_dir:
                raise ValueError("trainer.resume=true needs trainer.checkpoint_dir")
            path = checkpoint.resume_point(trainer.checkpoint_dir)  # skips corrupt ones
            self.progress = checkpoint.load(path, self.chunks, self.optimizer, self.scheduler)
            self.version = int(self.progress["version"])
            if self.lora is not None:
                self._load_adapters(path)

    def _reference(
        self, chunks: list[Any], model: ModelConfig, parallel: ParallelConfig
    ) -> list[Any]:
        """A frozen copy of the initial policy (same layout) for the KL term. It is taken
        before any checkpoint loads, so a resumed run gets the same reference."""
        from moerl.models.gpt import build_model

        ref = build_model(
            model, parallel, self.cfg.dtype, routing_replay=True, per_token_loss=True,
            use_te=self.use_te, expert_gemm=self.cfg.expert_gemm,
        )  # fmt: skip
        for mine, theirs in zip(ref, chunks):
            mine.load_state_dict(theirs.state_dict())
            mine.eval()
            mine.requires_grad_(False)
        return ref

    def step(
        self, trajs: list[Trajectory], *, decompose_sample: int = 0, flip_sample: int = 0
    ) -> dict[str, float]:
        """One rollout batch (rewards set): advantages over the batch, π_old and the IS
        correction over the batch before any update, the probes asked for (mismatch
        decomposition / router flip rates on that many trajectories: they measure the
        weights the batch's ratios use), then ``trainer.minibatches`` optimizer steps.
        Returns the metrics; the version bumps once."""
        from moerl.algo.credit import assign_credit
        from moerl.algo.offpolicy import needs_old_policy
        from moerl.trainer.offpolicy import prepare, turn_staleness

        missing = [f"{t.group_id}/{t.index}" for t in trajs if t.reward is None]
        if missing:
            raise ValueError(
                f"trajectories {missing[:5]} have no reward: score them before training"
            )
        rewards = torch.tensor([float(t.reward) for t in trajs])  # type: ignore[arg-type]
        with device_mode.suspended():  # host tensors only: no op needs the CPU mode
            adv = assign_credit(
                trajs, self.advantage_fn, credit=self.credit, discount=self.turn_discount
            )
        advantages = adv.advantages
        old, fuse = None, False
        if needs_old_policy(self.old_policy, self.correction_cfg):
            fuse = self.old_from_forward()
            old = None if fuse else self.policy_logprobs(trajs)
        probes: dict[str, float] = {}
        if decompose_sample:  # also measures the router flip rates
            probes.update(self.mismatch_decomposition(trajs, decompose_sample, old=old))
        if flip_sample and "router_flip/mean" not in probes:
            probes.update(self.router_flip_rates(trajs, flip_sample))
        offpolicy = prepare(
            trajs, advantages, old_logprobs=old,
            correction_fn=self.correction_fn if old is not None else None,
            use_mask=self.cfg.sampling_mask, current_version=self.version,
        )  # fmt: skip
        ref = self.reference_logprobs(trajs) if self.reference is not None else None
        results = [
            self._minibatch_step(trajs, advantages, offpolicy, ref, indices, fuse)
            for indices in self._minibatches(len(trajs))
        ]
        self.version += 1
        metrics = {**offpolicy.metrics, **_combine([r.metrics for r in results])}
        metrics.update({f"advantage/{k}": float(v) for k, v in adv.metrics.items()})
        metrics.update(turn_staleness(trajs, self.version - 1))
        metrics.update(version=float(self.version), reward_mean=float(rewards.mean()))
        norms = [float(r.grad_norm) for r in results if r.grad_norm is not None]
        if norms:  # before clipping; the mean over the batch's optimizer steps
            metrics["grad_norm"] = sum(norms) / len(norms)
        return {**metrics, **probes}

    def old_from_forward(self) -> bool:
        """Whether π_old comes from the training forward (trainer.old_policy_pass): with
        one optimizer step per batch, π_θ before the update is π_old, and a correction
        without a whole-batch statistic can weight each micro-batch on its own."""
        if self.cfg.old_policy_pass == "separate" or self.cfg.minibatches != 1:
            return False
        return not bool(getattr(self.correction_cfg, "batch_statistic", True))

    def _minibatches(self, num: int) -> list[list[int]]:
        """The batch's trajectory indices split in order into trainer.minibatches parts."""
        n = self.cfg.minibatches
        if num % n:
            raise ValueError(
                f"a batch of {num} trajectories does not split into trainer.minibatches={n}"
            )
        per = num // n
        return [list(range(k * per, (k + 1) * per)) for k in range(n)]

    def _minibatch_step(
        self,
        trajs: list[Trajectory],
        advantages: list[Advantage],
        offpolicy: Any,
        ref: list[Any] | None,
        indices: list[int],
        old_from_forward: bool = False,
    ) -> Any:
        """One optimizer step on the trajectories at ``indices``; ``old_from_forward``:
        π_old and the correction come from its own forward."""
        from moerl.trainer.rl_step import rl_train_step

        lr = self.current_lr()  # the lr this optimizer step uses
        result = rl_train_step(
            self.chunks, self.optimizer, [trajs[i] for i in indices],
            [advantages[i] for i in indices], loss_fn=self.loss_fn,
            offpolicy=offpolicy.select(indices), old_policy=self.old_policy,
            decoupled=self.decoupled, agg=self.agg, replay=self.cfg.replay,
            use_mask=self.cfg.sampling_mask, kl=self.kl,
            ref_logprobs=None if ref is None else [ref[i] for i in indices],
            old_from_forward=old_from_forward,
            correction_fn=self.correction_fn if old_from_forward else None, **self._batching(),
        )  # fmt: skip
        result.metrics["lr"] = lr
        self.scheduler.step(1)
        return result

    def policy_logprobs(self, trajs: list[Trajectory]) -> list[Any]:
        """Each trajectory's response-token logprobs under the current weights."""
        return self._logprobs(self.chunks, trajs)

    def reference_logprobs(self, trajs: list[Trajectory]) -> list[Any]:
        """Each trajectory's response-token logprobs under the reference policy."""
        assert self.reference is not None
        return self._logprobs(self.reference, trajs)

    def _logprobs(self, chunks: list[Any], trajs: list[Trajectory]) -> list[Any]:
        """Each trajectory's response-token logprobs under ``chunks`` (the policy before
        its update, or the reference), with the training forward's routing replay and
        sampling mask; no grad. Forwarded minibatch by minibatch, so each data-parallel
        rank forwards the trajectories it trains on (``moerl.trainer.shard``); every
        rank gets all of them."""
        from moerl.trainer.forward import trainer_logprobs

        out: list[Any] = [None] * len(trajs)
        for indices in self._minibatches(len(trajs)):
            res = trainer_logprobs(
                chunks, [trajs[i] for i in indices], replay=self.cfg.replay,
                use_mask=self.cfg.sampling_mask, **self._batching(),
            )  # fmt: skip
            for k, i in enumerate(indices):
                out[i] = res.logprobs[k]
        return out

    def router_flip_rates(self, trajs: list[Trajectory], sample: int = 8) -> dict[str, float]:
        """Per-layer router flip rate on a sample of ``trajs``: a forward without replay,
        compared with the engine's recorded routes (MoE layers; dense layers report 0)."""

        from moerl.trainer.forward import trainer_logprobs

        picked = [trajs[i] for i in self._sample(trajs, sample)]
        if not picked:
            return {}
        res = trainer_logprobs(
            self.chunks, picked, replay="none", use_mask=False, **self._batching()
        )
        return self._flip_metrics(res)

    def _flip_metrics(self, res: Any) -> dict[str, float]:
        rates = res.flip_rate()
        moe = [i for i in range(self.model.num_layers) if i >= self.model.first_k_dense_replace]
        out = {f"router_flip/layer{i}": float(rates[i]) for i in moe}
        out["router_flip/mean"] = float(rates[moe].mean()) if moe else 0.0
        return out

    def _batching(self) -> dict[str, Any]:
        """How every forward of this trainer batches and routes its trajectories."""
        return dict(
            micro_batch_size=self.micro_batch_size, num_layers=self.model.num_layers,
            topk=self.model.moe_router_topk, num_experts=self.model.num_experts,
            current_version=self.version, recent_window=self.cfg.recent_window,
            packing=self.cfg.packing, pack_length=self.cfg.pack_length,
            max_tokens=self.cfg.max_tokens_per_microbatch, logprobs_from=self.logprobs_from,
        )  # fmt: skip

    def _sample(self, trajs: list[Trajectory], sample: int) -> list[int]:
        """Indices of up to ``sample`` trajectories for a probe: the same whole number of
        micro-batches from each data-parallel rank's own trajectories, in rank order (so
        each rank's contiguous share is trajectories it holds whole); empty when there
        are too few, or some lack routes."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        from moerl.trainer.shard import owned_indices

        dp, mbs = parallel_state.get_data_parallel_world_size(), self.micro_batch_size
        owned = [owned_indices(len(trajs), self.cfg.minibatches, dp, r) for r in range(dp)]
        per_rank = min(len(owned[0]), max(mbs, -(-sample // (dp * mbs)) * mbs))
        per_rank -= per_rank % mbs
        mine = owned[parallel_state.get_data_parallel_rank()][:per_rank]
        ok = torch.tensor([int(all(trajs[i].routed_experts is not None for i in mine))])
        if dist.is_initialized() and dist.get_world_size() > 1:
            ok = all_reduce_host(ok, dist.ReduceOp.MIN)
        if not per_rank or not int(ok):
            return []
        return [i for r in range(dp) for i in owned[r][:per_rank]]

    def mismatch_decomposition(
        self, trajs: list[Trajectory], sample: int = 8, old: list[Any] | None = None
    ) -> dict[str, float]:
        """Trainer-vs-rollout mismatch (k3) on a sample of ``trajs``, split into routing
        (replay on/off), sampling mask (on/off), staleness (tokens of older versions) and
        numerics (the rest), by four forwards of the same tokens (two when no sampled
        trajectory carries a sampling mask: then on and off are one forward); with the router flip
        rates of its no-replay forward. ``old``, the step's π_old of every trajectory,
        stands in for the replay-and-mask forward when the trainer replays all routes
        with the mask (it is that forward). Needs a model built with routing replay
        (trainer.replay != 'none'); {} otherwise."""
        import numpy as np

        from moerl.telemetry.metrics import decomposition_metrics
        from moerl.telemetry.mismatch import decompose
        from moerl.trainer.forward import trainer_logprobs

        indices = self._sample(trajs, sample)
        picked = [trajs[i] for i in indices]
        if is_none(self.cfg.replay) or not picked:
            return {}
        runs, flips = {}, {}
        # without a sampling mask (a sampling that truncates nothing records none) the
        # mask changes nothing: the masked forward is the full-vocabulary one
        masked = any(t.has_sampling_mask for t in picked)
        for replay in ("all", "none"):
            for mask in (True, False):
                if old is not None and (replay, mask) == (self.cfg.replay, self.cfg.sampling_mask):
                    runs[replay, mask] = np.concatenate([old[i] for i in indices])
                    continue
                if not masked and (replay, not mask) in runs:
                    runs[replay, mask] = runs[replay, not mask]
                    continue
                res = trainer_logprobs(
                    self.chunks, picked, replay=replay, use_mask=mask, **self._batching()
                )
                runs[replay, mask] = np.concatenate([res.logprobs[i] for i in range(len(picked))])
                if replay == "none":  # the router_flip_rates forward (routes: mask or not)
                    flips = self._flip_metrics(res)

        def cat(field: str) -> np.ndarray:
            return np.concatenate(
                [np.asarray(getattr(t, field) if getattr(t, field) is not None
                            else t.response_logprobs, dtype=np.float64) for t in picked]
            )  # fmt: skip

        trained = np.concatenate([t.trained for t in picked])  # not an episode's observations
        stale = np.concatenate([np.asarray(t.versions) < self.version for t in picked])
        dec = decompose(
            replay_mask_T=runs["all", True][trained],
            fresh_route_mask_T=runs["none", True][trained],
            replay_full_vocab_T=runs["all", False][trained],
            fresh_route_full_vocab_T=runs["none", False][trained],
            rollout_sampling_T=cat("sampling_logprobs")[trained],
            rollout_full_T=cat("response_logprobs")[trained], stale_T=stale[trained],
        )  # fmt: skip
        return {**decomposition_metrics(dec), **flips}

    def adapters(self) -> dict[str, Any]:
        """The full LoRA adapters under PEFT names on rank 0 ({} elsewhere; collective)."""
        from moerl.lora import gather_adapters

        return gather_adapters(self.chunks, self.model)

    def peft_config(self) -> dict[str, Any]:
        from moerl.lora import peft_config

        assert self.lora is not None
        return peft_config(self.lora, self.model)

    def _load_adapters(self, path: Path | None) -> None:
        from moerl.lora import load_adapters_into, load_peft

        if path is None or not (path / "adapter").is_dir():
            raise FileNotFoundError(
                f"checkpoint {path} has no adapter/ directory: it was not written by a LoRA "
                "run; resume without lora or from a LoRA checkpoint"
            )
        tensors, _ = load_peft(path / "adapter")
        load_adapters_into(self.chunks, tensors)

    def current_lr(self) -> float:
        """The lr the next optimizer step applies (log it before ``scheduler.step(1)``)."""
        from moerl.trainer.schedule import current_lr

        return current_lr(self.optimizer)

    def save(self, **progress: Any) -> Path:
        """Checkpoint model, optimizer, lr schedule, RNG and progress (version, plus
        ``progress``), the model config and tokenizer files an HF export needs; with LoRA
        also the adapters as a PEFT directory (``adapter/``)."""
        from moerl.trainer import checkpoint

        if not self.cfg.checkpoint_dir or self.cfg.checkpoint_dir == "auto":
            raise ValueError(
                f"trainer.checkpoint_dir={self.cfg.checkpoint_dir!r}: nowhere to save "
                "('auto' is resolved by moerl.launch to <run dir>/checkpoints; set a folder)"
            )
        from moerl.convert.mcore_ckpt import write_model_files

        adapters = None
        if self.lora is not None:
            adapters = (self.adapters(), self.peft_config())

        def extra(tmp: Path) -> None:
            # the model config, family and tokenizer: tools/convert_checkpoint.py mcore2hf
            # exports the checkpoint from its directory alone
            write_model_files(tmp, self.model, self.hf_dir)
            if adapters is not None:
                from moerl.lora import save_peft

                save_peft(tmp / "adapter", *adapters)

        return checkpoint.save(
            self.cfg.checkpoint_dir,
            self.version,
            self.chunks,
            {"version": self.version, **progress},
            self.optimizer,
            keep=self.cfg.keep_checkpoints,
            extra=extra,
            scheduler=self.scheduler,
        )


def _combine(per_step: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of a batch's optimizer steps: the mean of each key over the steps that
    report it, the maximum for keys ending in ``_max``."""
    out: dict[str, float] = {}
    for key in {k for m in per_step for k in m}:
        values = [m[key] for m in per_step if key in m]
        out[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
    return out
