"""Verifiable-reward tasks: a deterministic prompt stream plus a reward function.

`build_task(cfg.task, tokenizer)` gives the configured task; see `base.py` for the
contract the orchestrator uses, `synthetic.py` for the built-in generators, `jsonl.py` and
`dataset.py` for bring-your-own data, `rewards.py` for the reward functions and `verifiers/`
for the verifiers (`math`, `format_length`, `code`), registered on import.
"""

from moerl.tasks.base import Prompt, RewardFn, Task
from moerl.tasks.dataset import DatasetTask, load_rows
from moerl.tasks.indexed import IndexedTask, encode_prompt, encode_target
from moerl.tasks.jsonl import JsonlTask, read_records
from moerl.tasks.registry import TASKS, build_task, check_task_config
from moerl.tasks.rewards import REWARDS, RewardInput, build_reward, decode_response
from moerl.tasks.synthetic import ArithmeticTask, CopyDigitsTask
from moerl.tasks.verifiers import math_answer  # noqa: F401  (registers the verifiers)
from moerl.tasks.warm_start import warm_start_examples

__all__ = [
    "REWARDS",
    "TASKS",
    "ArithmeticTask",
    "CopyDigitsTask",
    "DatasetTask",
    "IndexedTask",
    "JsonlTask",
    "Prompt",
    "RewardFn",
    "RewardInput",
    "Task",
    "build_reward",
    "build_task",
    "check_task_config",
    "decode_response",
    "encode_prompt",
    "encode_target",
    "load_rows",
    "read_records",
    "warm_start_examples",
]
