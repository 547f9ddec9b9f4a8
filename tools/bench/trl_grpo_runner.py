"""TRL's GRPOTrainer on moerl's main job, one process per run (the TRL side of vs_trl.py).

    python tools/bench/trl_grpo_runner.py --model DIR --steps 20 --out DIR [--threads N]

Trains the checkpoint at --model (written by vs_trl.py with moerl's tiny-model writer)
on moerl's own copy_digits prompts and `shaped` reward, with the recipe's settings
(recipes/deepseek_moe.yaml): G=8, 32 completions per optimizer step (4 prompts x 8), 8
new tokens, temperature 1, top_p 1, no top-k; AdamW lr 5e-3 after a 2-step linear
warmup from 0, betas 0.9/0.999, eps 1e-6, weight decay 0.01, grad clip 1.0; beta 0 (no
KL, no reference model), one optimizer step per generation batch, PPO clip 0.2 with a
token mean over the batch (loss_type="dapo"); fp32 (on the GPU when there is one, as moerl picks it), nothing logged or saved.

Writes OUT/steps.jsonl: a `train_begin` line (unix time when the trainer's loop starts,
after the model, tokenizer and trainer are built), then one line per optimizer step
(`step`, `wall_time` at the step's end, `reward`: the batch's mean reward as TRL logs
it, `parts`: the seconds the step spent in TRL's own calls, timed around them:
`generate` (generation and scoring), `loss_forward`, `backward`, `optimizer`). vs_trl.py
starts this script, polls its memory and reads the file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

# the recipe's numbers (recipes/deepseek_moe.yaml, conf/trainer/default.yaml)
GROUP = 8
BATCH = 32
NEW_TOKENS = 8
LR = 5e-3
WARMUP = 2
SEED = 1234


def copy_digits(model: Path, n: int) -> tuple[Any, Any, list[Any]]:
    """moerl's tokenizer, task (copy_digits, the recipe's options) and its first n
    prompts: the stream the moerl runs read from position 0."""
    from moerl.config.task import CopyDigitsTaskConfig
    from moerl.models.tokenizer import load_tokenizer
    from moerl.tasks.registry import build_task

    tokenizer = load_tokenizer(model)
    task = build_task(CopyDigitsTaskConfig(), tokenizer)
    return tokenizer, task, [task.prompt(pos) for pos in range(n)]


def reward_function(tokenizer: Any, task: Any, prompts: list[Any]) -> Any:
    """moerl's task reward as a TRL reward function: each completion's ids (TRL cuts them
    after the first EOS) become a moerl Trajectory scored by ``task.reward``."""
    import numpy as np

    from moerl.common.trajectory import Trajectory

    eos = tokenizer.eos_token_id

    def copy_digits_reward(
        completion_ids: list[list[int]], pos: list[int], **_: Any
    ) -> list[float]:
        rewards = []
        for ids, p in zip(completion_ids, pos, strict=True):
            prompt = prompts[p]
            response = np.asarray(ids, dtype=np.int32)
            traj = Trajectory(
                prompt_ids=prompt.input_ids,
                response_ids=response,
                response_logprobs=np.zeros(len(ids), np.float32),
                versions=np.zeros(len(ids), np.int32),
                finish_reason="stop" if ids and ids[-1] == eos else "length",
            )
            rewards.append(float(task.reward(prompt, traj)))
        return rewards

    return copy_digits_reward


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="HF checkpoint directory")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--out", type=Path, required=True, help="steps.jsonl goes here")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all cores)")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from moerl.device import has_cuda

    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "steps.jsonl").open("w")

    def record(**fields: Any) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    parts: dict[str, float] = {}  # the running step's seconds in TRL's own calls

    def timed(name: str, call: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*a, **kw)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0

        return run

    class StepLog(TrainerCallback):  # type: ignore[misc]
        """Unix time at the loop's start and at each step's end, TRL's logged reward and
        the step's parts."""

        end: float = 0.0
        step_parts: dict[str, float] = {}
        optimizer_t0: float = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            record(event="train_begin", wall_time=time.time())

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.optimizer_t0 = time.perf_counter()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            parts["optimizer"] = time.perf_counter() - self.optimizer_t0

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.end = time.time()
            self.step_parts = dict(parts)
            parts.clear()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:  # logging_steps=1: once per step, after its end
                record(step=state.global_step - 1, wall_time=self.end, reward=logs["reward"],
                       parts=self.step_parts)  # fmt: skip

    prompts_per_step = BATCH // GROUP
    tokenizer, task, prompts = copy_digits(args.model, args.steps * prompts_per_step)
    # the tiny tokenizer adds no BOS itself; moerl's encode_prompt puts it first, so TRL's
    # `tokenizer(prompt)` gets it as text and both see the same prompt ids
    bos = tokenizer.bos_token or ""
    data = Dataset.from_dict(
        {"prompt": [bos + p.text for p in prompts], "pos": list(range(len(prompts)))}
    )
    config = GRPOConfig(
        output_dir=str(args.out / "trl"),
        use_cpu=not has_cuda(),  # the GPU when there is one, as moerl's run picks it
        bf16=False,
        fp16=False,
        seed=SEED,
        max_steps=args.steps,
        per_device_train_batch_size=BATCH,  # completions per optimizer step
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,  # the prompts in moerl's stream order
        learning_rate=LR,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=WARMUP,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-6,
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",  # token mean over the batch, as moerl's agg=token_mean
        scale_rewards="group",
        router_aux_loss_coef=0.0,  # moerl: moe_aux_loss_coeff 0
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        gradient_checkpointing=False,  # moerl: trainer.recompute=none
        log_completions=False,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_function(tokenizer, task, prompts),
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepLog()],
    )
    # timers around TRL's own calls (instance attributes: its methods call them so)
    trainer._generate_and_score_completions = timed(
        "generate", trainer._generate_and_score_completions
    )
    trainer.compute_loss = timed("loss_forward", trainer.compute_loss)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    trainer.train()
    log.close()


if __name__ == "__main__":
    main()
