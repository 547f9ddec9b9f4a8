"""The top-level config: one field per Hydra config group."""

from __future__ import annotations

from dataclasses import dataclass, field

from moerl.algo.config import AlgoConfig
from moerl.algo.correction_config import CorrectionConfig
from moerl.config.buffer import BufferConfig, StalenessConfig
from moerl.config.engine import EngineConfig
from moerl.config.env import EnvConfig
from moerl.config.eval import EvalConfig
from moerl.config.launcher import LauncherConfig
from moerl.config.lora import LoraConfig
from moerl.config.model import ModelConfig
from moerl.config.parallel import ParallelConfig
from moerl.config.reward_model import RewardModelConfig
from moerl.config.rollout import RolloutConfig
from moerl.config.sync import SyncConfig
from moerl.config.task import TaskConfig
from moerl.config.telemetry import TelemetryConfig
from moerl.config.trainer import TrainerConfig


@dataclass
class MoerlConfig:
    """Everything a moerl job reads; `conf/config.yaml` picks one option per group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture of the policy model (group `model`)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer layout: TP, PP, EP, ETP; DP is derived (group `parallel`)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Optimisation, precision, checkpoints (group `trainer`)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Where rollouts are generated (group `engine`)."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """Process count and collective backend (group `launcher`)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The RL objective: advantage estimator, policy loss, KL term (group `algo`)."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Importance-sampling correction of the rollout/trainer mismatch (group `correction`)."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """Rollout buffer: capacity and the order the trainer takes groups in (group `buffer`)."""
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    """How stale a consumed group may be; whether generation waits for the trainer
    (group `staleness`)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight sync to the engines (group `sync`)."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """Progress line, metrics and timeline files, optional TensorBoard/W&B."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and the verifiable reward (group `task`)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment of multi-turn / multi-agent episodes; `none` = single-turn
    rollouts (group `env`)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Group sampling, filtering, partial rollouts (group `rollout`)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA: train and sync adapters only (group `lora`)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A reward model served over HTTP (an outcome judge or a process reward model),
    scored off the critical path next to the task's reward (group `reward_model`)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation during training, through the same engines (group `eval`)."""
