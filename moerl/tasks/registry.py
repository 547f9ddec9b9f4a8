"""Tasks by name: `task=copy_digits` in config, `build_task(cfg, tokenizer)` in code.

Built-ins register a factory `fn(tokenizer, cfg) -> Task` with their options dataclass
(moerl.config.task). A task outside moerl is `task=custom task._target_=mylab.tasks.MyTask`
with keyword arguments in `task.options`; it is called as `MyTask(tokenizer, **options)` and
must satisfy the `Task` protocol (moerl.tasks.base).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moerl.common.registry import Registry
from moerl.config.task import (
    ArithmeticTaskConfig,
    CopyDigitsTaskConfig,
    CustomTaskConfig,
    DatasetTaskConfig,
    JsonlTaskConfig,
    TaskConfig,
)
from moerl.tasks.base import Task
from moerl.tasks.dataset import DatasetTask, load_rows
from moerl.tasks.jsonl import JsonlTask, read_records
from moerl.tasks.rewards import build_reward
from moerl.tasks.synthetic import ArithmeticTask, CopyDigitsTask

TASKS: Registry[Any, Task] = Registry("task", "task")


@TASKS.register("arithmetic", ArithmeticTaskConfig)
def arithmetic(tokenizer: Any, cfg: ArithmeticTaskConfig) -> Task:
    return ArithmeticTask(tokenizer, cfg)


@TASKS.register("copy_digits", CopyDigitsTaskConfig)
def copy_digits(tokenizer: Any, cfg: CopyDigitsTaskConfig) -> Task:
    return CopyDigitsTask(tokenizer, cfg)


@TASKS.register("jsonl", JsonlTaskConfig)
def jsonl(tokenizer: Any, cfg: JsonlTaskConfig) -> Task:
    return JsonlTask(tokenizer, cfg)


@TASKS.register("dataset", DatasetTaskConfig)
def dataset(tokenizer: Any, cfg: DatasetTaskConfig) -> Task:
    return DatasetTask(tokenizer, cfg)


def check_task_config(spec: str | TaskConfig | Any) -> None:
    """Start-up check without a tokenizer: the task name, its option ranges, the reward
    function and its options, a `_target_`'s import, a jsonl file's records, a dataset's
    files, split and columns."""
    from omegaconf import DictConfig, OmegaConf

    TASKS.build(spec)  # name, options and ranges; imports a `_target_`
    cfg: Any = OmegaConf.to_object(spec) if isinstance(spec, DictConfig) else spec
    if isinstance(cfg, str):
        cfg = TASKS.config_type(cfg)()
    elif isinstance(cfg, Mapping):
        if cfg.get("_target_"):
            return
        options: dict[str, Any] = {str(k): v for k, v in cfg.items()}
        cfg = TASKS.config_type(options["name"])(**options)
    if isinstance(cfg, CustomTaskConfig) or not isinstance(cfg, TaskConfig):
        return
    default = "shaped" if isinstance(cfg, CopyDigitsTaskConfig) else "exact"
    build_reward(cfg.reward or default, dict(cfg.reward_options))
    if isinstance(cfg, JsonlTaskConfig):
        read_records(cfg.path, cfg.prompt_key, cfg.answer_key)
    if isinstance(cfg, DatasetTaskConfig):
        load_rows(cfg)


def build_task(spec: str | TaskConfig | Any, tokenizer: Any) -> Task:
    """The task for a name, an options dataclass (what Hydra composes, `DictConfig` too),
    a mapping with `name` or `_target_`; checked against the `Task` protocol. A spec's
    ``chat_template_file`` replaces ``tokenizer``'s chat template first."""
    file = spec.get("chat_template_file") if isinstance(spec, Mapping) else None
    file = file or getattr(spec, "chat_template_file", None)
    if file:
        tokenizer.chat_template = Path(file).read_text()
    task = TASKS.build(spec)(tokenizer)
    if not isinstance(task, Task):
        raise TypeError(
            f"task: {type(task).__name__} is not a Task; it needs prompts(start) and "
            "reward(prompt, traj) (moerl.tasks.base.Task)"
        )
    return task
