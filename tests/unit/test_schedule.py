"""The lr schedule: megatron-core's scheduler built from TrainerConfig matches the hand
formulas at every optimizer step, and a saved schedule continues where it stopped."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moerl.config.trainer import TrainerConfig
from moerl.trainer.schedule import build_scheduler, current_lr, load_scheduler_state

PEAK, FLOOR = 1.0e-3, 1.0e-4


def _optimizer(lr: float = PEAK) -> torch.optim.Optimizer:
    """AdamW with groups shaped like megatron-core's: a decayed one and a wd-exempt one."""
    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    groups = [
        {"params": [w], "wd_mult": 1.0, "max_lr": lr, "min_lr": FLOOR, "default_config": True},
        {"params": [b], "wd_mult": 0.0, "max_lr": lr, "min_lr": FLOOR, "default_config": True},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def _hand_lr(schedule: str, n: int, warmup: int, decay: int) -> float:
    """The lr of the optimizer step taken after n steps (Megatron-LM's convention)."""
    if warmup > 0 and n <= warmup:
        return PEAK * n / warmup
    if schedule == "constant":
        return PEAK
    if n > decay:
        return FLOOR
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
    return FLOOR + coeff * (PEAK - FLOOR)


def _cfg(schedule: str, warmup: int, decay_steps: int = 0, **kw: object) -> TrainerConfig:
    return TrainerConfig(
        lr=PEAK, min_lr=FLOOR, lr_schedule=schedule, lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps, train_iters=6, minibatches=2, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_at_every_step_matches_hand_formula(schedule: str, warmup: int) -> None:
    cfg = _cfg(schedule, warmup, weight_decay=0.1)
    opt = _optimizer()
    sched = build_scheduler(opt, cfg)
    decay = 6 * 2  # lr_decay_steps=0: train_iters × minibatches
    got = []
    for _ in range(decay + 3):  # past the end: the floor holds
        got.append(current_lr(opt))
        assert [g["lr"] for g in opt.param_groups] == [got[-1]] * 2
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # wd_mult
        sched.step(1)
    want = [_hand_lr(schedule, n, warmup, decay) for n in range(decay + 3)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    if warmup:
        assert got[0] == 0.0 and got[warmup] == PEAK  # first step at 0, peak after warmup
    if schedule != "constant":
        assert got[decay - 1] > FLOOR and got[decay] == pytest.approx(FLOOR)


def test_decay_steps_override_the_run_length() -> None:
    opt = _optimizer()
    sched = build_scheduler(opt, _cfg("linear", 2, decay_steps=5))
    got = []
    for _ in range(8):
        got.append(current_lr(opt))
        sched.step(1)
    assert got == pytest.approx([_hand_lr("linear", n, 2, 5) for n in range(8)])
    assert got[5:] == pytest.approx([FLOOR] * 3)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_saved_schedule_continues(schedule: str) -> None:
    """Save after k steps (through JSON, as progress.json does), rebuild, load: the lr at
    every later step equals the uninterrupted run's."""
    cfg, k = _cfg(schedule, 3), 5
    straight_opt = _optimizer()
    straight = build_scheduler(straight_opt, cfg)
    want = []
    for _ in range(12):
        want.append(current_lr(straight_opt))
        straight.step(1)

    first_opt = _optimizer()
    first = build_scheduler(first_opt, cfg)
    for _ in range(k):
        first.step(1)
    saved = json.loads(json.dumps(first.state_dict()))

    resumed_opt = _optimizer()
    resumed = build_scheduler(resumed_opt, cfg)
    load_scheduler_state(resumed, saved)
    assert resumed.num_steps == k
    got = []
    for _ in range(12 - k):
        got.append(current_lr(resumed_opt))
        resumed.step(1)
    assert got == want[k:]


def test_resumed_schedule_takes_the_new_config() -> None:
    """The step count comes from the checkpoint; lr and min_lr from the config, even where
    the restored optimizer groups still carry the old bounds."""
    old, new = _cfg("linear", 0), _cfg("linear", 0)
    new.lr = 2 * PEAK
    first = build_scheduler(_optimizer(), old)
    first.step(4)
    stale_groups = _optimizer(lr=PEAK)  # groups as the optimizer checkpoint restores them
    resumed = build_scheduler(stale_groups, new)
    load_scheduler_state(resumed, first.state_dict())
    ratio = 4 / 12
    assert current_lr(stale_groups) == pytest.approx(FLOOR + (1 - ratio) * (2 * PEAK - FLOOR))
