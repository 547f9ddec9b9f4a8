"""Options of the verifiable-reward tasks (group `task`, conf/task/).

One dataclass per built-in task, each a subclass of `TaskConfig` so Hydra can merge any
option into the slot: `task=arithmetic task.max_operand=99`. The tasks themselves live in
`moerl.tasks`, registered under the same names; `task=custom task._target_=mylab.MyTask`
plugs in a task outside moerl (`fn(tokenizer, **options) -> Task`).

Every task scores completions with a reward function picked by name (`task.reward=prefix`,
options as `+task.reward_options.stop_weight=0.2`) or by import path (a name with a dot:
`task.reward=mylab.rewards.f`, called as `f(RewardInput, **reward_options) -> float`).
Torch-free, like the other config modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moerl.common.checks import at_least

if TYPE_CHECKING:
    from hydra.core.config_store import ConfigStore

ARITH_OPS = "+-*"


@dataclass
class TaskConfig:
    """The task slot: where prompts come from and how completions are scored."""

    name: str = "copy_digits"
    """Task registered in moerl.tasks.TASKS; pick one with `task=NAME`."""
    seed: int = 0
    """Seed of the prompt stream; the same seed and cursor give the same prompts."""
    num_prompts: int = 0
    """0 = endless (a fresh prompt at every position); N > 0 = a fixed set of N prompts,
    repeated in epochs (reshuffled per epoch when `shuffle`)."""
    shuffle: bool = True
    """With a fixed set: visit it in a new seeded order every epoch."""
    reward: str = ""
    """Reward function: a built-in (exact, prefix, numeric, shaped) or the import path of
    `fn(RewardInput, **reward_options) -> float` (any name containing a dot); '' = the
    task's own default (shaped for copy_digits, exact otherwise)."""
    reward_options: dict[str, Any] = field(default_factory=dict)
    """Options of the reward function (`+task.reward_options.stop_weight=0.2`)."""
    chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template as one user turn (instruct
    checkpoints); false = the raw text, with the tokenizer's BOS if it has one."""
    system_prompt: str = ""
    """With `chat_template`: a system message put before each prompt's messages (unless
    they already start with one); '' = none."""
    chat_template_file: str = ""
    """With `chat_template`: a Jinja file that replaces the tokenizer's own chat template
    for this run (its prompts, training and eval alike); '' = the tokenizer's."""

    def validate(self, key: str) -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""
        at_least(f"{key}.num_prompts", self.num_prompts, 0)
        if self.chat_template_file:
            if not self.chat_template:
                raise ValueError(
                    f"{key}.chat_template_file is set but {key}.chat_template=false; set "
                    f"{key}.chat_template=true to wrap prompts in it"
                )
            if not Path(self.chat_template_file).is_file():
                raise ValueError(
                    f"{key}.chat_template_file={self.chat_template_file!r} is not a file; give "
                    "the path of a Jinja chat template"
                )
        if self.system_prompt and not self.chat_template:
            raise ValueError(
                f"{key}.system_prompt is set but {key}.chat_template=false; a system prompt "
                f"goes through the tokenizer's chat template: set {key}.chat_template=true"
            )


@dataclass
class ArithmeticTaskConfig(TaskConfig):
    """`12+7=` -> `19`: integer expressions with the usual precedence."""

    name: str = "arithmetic"
    """Registered name of this task."""
    min_operand: int = 0
    """Smallest operand (inclusive, >= 0)."""
    max_operand: int = 20
    """Largest operand (inclusive)."""
    num_operands: int = 2
    """Operands per expression (>= 2)."""
    ops: str = "+-"
    """Operators to draw from, any of '+', '-', '*'."""
    reward: str = "exact"
    """exact: 1 for the exact answer followed by EOS; `prefix` or `shaped` give partial
    credit (see moerl.tasks.rewards)."""

    def validate(self, key: str) -> None:
        super().validate(key)
        at_least(f"{key}.min_operand", self.min_operand, 0)
        at_least(f"{key}.max_operand", self.max_operand, self.min_operand)
        at_least(f"{key}.num_operands", self.num_operands, 2)
        bad = sorted(set(self.ops) - set(ARITH_OPS))
        if not self.ops or bad:
            raise ValueError(
                f"{key}.ops={self.ops!r} must be a non-empty string of the operators "
                f"{ARITH_OPS!r}" + (f"; {''.join(bad)!r} is not one" if bad else "")
            )


@dataclass
class CopyDigitsTaskConfig(TaskConfig):
    """`372=` -> `372`: echo the digits of the prompt. Made for tiny random-init models:
    the `shaped` reward gives dense credit for digits, right digits and stopping, so
    uniform random sampling already scores non-zero and varies within a group."""

    name: str = "copy_digits"
    """Registered name of this task."""
    min_digits: int = 1
    """Fewest digits to copy (>= 1)."""
    max_digits: int = 3
    """Most digits to copy; keep it below the response budget (max_new_tokens)."""
    reward: str = "shaped"
    """shaped: format + per-position match + stop credit; `exact` for the strict check."""

    def validate(self, key: str) -> None:
        super().validate(key)
        at_least(f"{key}.min_digits", self.min_digits, 1)
        at_least(f"{key}.max_digits", self.max_digits, self.min_digits)


@dataclass
class JsonlTaskConfig(TaskConfig):
    """Prompt/answer records from a local jsonl file, one JSON object per line."""

    name: str = "jsonl"
    """Registered name of this task."""
    path: str = ""
    """The jsonl file (required)."""
    prompt_key: str = "prompt"
    """Field of each record holding the prompt text."""
    answer_key: str = "answer"
    """Field of each record holding the reference answer (any JSON value)."""
    num_prompts: int = 0
    """0 = every record of the file, in epochs; N > 0 = the first N records only."""

    def validate(self, key: str) -> None:
        super().validate(key)
        if not self.path:
            raise ValueError(f"{key}.path is empty; set it to a local jsonl file")


DATASET_FORMATS = ("parquet", "json", "arrow")


@dataclass
class DatasetTaskConfig(TaskConfig):
    """Prompts from local parquet, JSON Lines or Arrow files, or a directory written by
    `datasets.save_to_disk`, read through HF `datasets` (the `data` extra; never the hub).

    Splits: the dataset's own (`split=train`, `eval_split=test`: a save_to_disk
    DatasetDict, or a directory of files named by split, such as train.parquet and
    test.parquet), or a held-out part carved from one split (`eval_fraction`, drawn with
    `split_seed`, the same rows whatever the run seed)."""

    name: str = "dataset"
    """Registered name of this task."""
    path: str = ""
    """A local data file, a glob of files, or a directory (save_to_disk output or data files
    named by split) (required)."""
    format: str = ""
    """parquet, json (JSON Lines) or arrow; '' = from the file suffix (.parquet, .jsonl,
    .json, .arrow)."""
    split: str = "train"
    """The dataset split to read prompts from (a single file is split 'train')."""
    eval_split: str = ""
    """The split an evaluation reads ('test'); '' = the held-out part of `split` when
    `eval_fraction` > 0."""
    eval_fraction: float = 0.0
    """Fraction of `split` held out for evaluation (0 <= f < 1); the task trains on the
    rest, and `heldout=true` reads the held-out rows instead."""
    split_seed: int = 0
    """Seed of the held-out draw; independent of `seed`, so runs with different seeds
    evaluate on the same rows."""
    heldout: bool = False
    """Read the held-out part (`eval_fraction`) instead of the training part."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (used when `messages_key` is empty)."""
    messages_key: str = ""
    """Column holding the prompt as chat messages ([{role, content}, ...]); needs
    `chat_template=true`; '' = use `prompt_key`."""
    answer_key: str = "answer"
    """Column holding the reference answer."""
    metadata_keys: list[str] = field(default_factory=list)
    """Columns copied into each Prompt.meta (e.g. ['difficulty']), for rewards and logs."""
    cache_dir: str = ""
    """Where `datasets` keeps its Arrow cache of parquet/json files; '' = its default
    (~/.cache/huggingface/datasets, or HF_DATASETS_CACHE)."""
    num_prompts: int = 0
    """0 = every row of the split (or of its training part), in epochs; N > 0 = the first
    N rows only."""

    def validate(self, key: str) -> None:
        super().validate(key)
        if not self.path:
            raise ValueError(
                f"{key}.path is empty; set it to a local parquet, jsonl or arrow file, or a "
                "datasets.save_to_disk directory"
            )
        if "://" in self.path:
            raise ValueError(
                f"{key}.path={self.path!r} is a URL; task=dataset reads local files only "
                "(download the data first, e.g. with `huggingface-cli download`)"
            )
        if self.format and self.format not in DATASET_FORMATS:
            raise ValueError(
                f"{key}.format={self.format!r} is not one of {', '.join(DATASET_FORMATS)} "
                "(or '' to infer it from the file suffix)"
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"{key}.eval_fraction={self.eval_fraction} must be in [0, 1)")
        if self.heldout and self.eval_fraction == 0.0:
            raise ValueError(f"{key}.heldout=true needs {key}.eval_fraction > 0")
        if self.messages_key and not self.chat_template:
            raise ValueError(
                f"{key}.messages_key={self.messages_key!r} gives chat messages, which need "
                f"the tokenizer's chat template: set {key}.chat_template=true"
            )
        if "item" in self.metadata_keys:
            raise ValueError(f"{key}.metadata_keys: 'item' is reserved (the row index)")

    def for_eval(self) -> DatasetTaskConfig:
        """The same data's evaluation view: `eval_split`, else the held-out part; in file
        order (no shuffle)."""
        if self.eval_split:
            return replace(
                self,
                split=self.eval_split,
                eval_fraction=0.0,
                heldout=False,
                shuffle=False,
                num_prompts=0,
            )
        if self.eval_fraction > 0:
            return replace(self, heldout=True, shuffle=False, num_prompts=0)
        raise ValueError(
            "task=dataset has no evaluation data: set task.eval_split (a split of the "
            "dataset, e.g. test) or task.eval_fraction (a held-out part of task.split)"
        )


@dataclass
class CustomTaskConfig(TaskConfig):
    """A task outside moerl: `fn(tokenizer, **options) -> Task` (a class works too)."""

    name: str = "custom"
    """Marks the escape hatch; the factory is found through `_target_`."""
    _target_: str = ""
    """Import path of the factory, e.g. 'mylab.tasks.MyTask'."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the factory (`+task.options.level=3`)."""


TASK_OPTIONS: dict[str, type[TaskConfig]] = {
    "arithmetic": ArithmeticTaskConfig,
    "copy_digits": CopyDigitsTaskConfig,
    "jsonl": JsonlTaskConfig,
    "dataset": DatasetTaskConfig,
    "custom": CustomTaskConfig,
}


def register_task_configs(cs: ConfigStore) -> None:
    """Store one schema per task (`base_NAME`) in the group `task`; the group base
    (`base_task`) is stored by moerl.config.store with the other groups."""
    for name, schema in TASK_OPTIONS.items():
        cs.store(group="task", name=f"base_{name}", node=schema, provider="moerl")
