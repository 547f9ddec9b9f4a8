"""The learning-rate schedule: megatron-core's OptimizerParamScheduler built from config.

The scheduler counts optimizer steps. It sets every param group's ``lr`` and
``weight_decay`` (times the group's ``wd_mult``: megatron-core exempts biases and norms)
for the step about to run, so the step loop calls, after each successful
``optimizer.step()``::

    lr = current_lr(optimizer)  # the lr that step used, for metrics["lr"]
    scheduler.step(1)           # set the next step's lr

With warmup, megatron's lr after n steps is lr × n / lr_warmup_steps (init lr 0, as in
Megatron-LM and verl); after it, 'linear' and 'cosine' decay to min_lr at
``lr_decay_steps`` (0 = train_iters × minibatches) and hold it.
"""

from __future__ import annotations

from typing import Any

from moerl.config.trainer import TrainerConfig


def total_steps(cfg: TrainerConfig) -> int:
    """Optimizer steps in the run: one per minibatch of every rollout batch."""
    return cfg.train_iters * cfg.minibatches


def decay_steps(cfg: TrainerConfig) -> int:
    """Optimizer steps until the decay reaches min_lr (warmup included)."""
    return cfg.lr_decay_steps or total_steps(cfg)


def build_scheduler(optimizer: Any, cfg: TrainerConfig) -> Any:
    """megatron-core's scheduler over ``optimizer`` (anything with ``param_groups``); it
    sets the first step's lr at once.

    Resume with ``load_scheduler_state``, not ``load_state_dict``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=decay_steps(cfg),
        lr_decay_style=cfg.lr_schedule,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=decay_steps(cfg),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def load_scheduler_state(scheduler: Any, state: dict[str, Any]) -> None:
    """Continue a saved schedule: the step count comes from ``state``; lr, min_lr,
    warmup, decay steps and style from the config the scheduler was built with, so a
    resumed run may change them. Call it after the optimizer state is loaded: that
    restores the saved groups' own lr bounds, which megatron reads before the
    scheduler's."""
    for group in scheduler.optimizer.param_groups:
        if group.get("default_config", False):
            group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def current_lr(optimizer: Any) -> float:
    """The lr the next optimizer step applies (the schedule's, on the default groups)."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    if lr is None:  # a plain torch optimizer's groups carry no 'default_config'
        lr = optimizer.param_groups[0]["lr"]
    return float(lr)
