"""What the run reports: console progress, metrics.jsonl, timeline, optional mirrors."""

from __future__ import annotations

from dataclasses import dataclass

CONSOLE_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class TelemetryConfig:
    """Run telemetry; files go to the run directory (Hydra's hydra.run.dir)."""

    console_level: str = "warning"
    """The least severe log records printed on the console: debug, info, warning or
    error. Every record at INFO and above (megatron-core's included) goes to
    run_dir/logs/rankN.log whatever this is; moerl's own lines and the progress line are
    always printed."""
    progress_interval_s: float = 10.0
    """Seconds between progress lines when stdout is not a terminal (CI, SLURM logs)."""
    flip_every: int = 5
    """Measure the router flip rate (a no-replay forward on a sample) every this many
    steps; 0 = never."""
    flip_sample: int = 8
    """Trajectories in that sample (also for the mismatch decomposition)."""
    decompose_every: int = 10
    """Split trainer-vs-rollout mismatch into routing / sampling mask / staleness /
    numerics (four forwards of a sample) every this many steps; 0 = never."""
    stall_warn_steps: int = 5
    """Warn once this many steps in a row had no group with any spread of rewards (every
    sample of each group scored alike: the advantages and the policy gradient are 0, the
    policy stops learning), naming the likely cause (every response cut at
    rollout.max_new_tokens, every reward 0); again after it recovers and stalls anew.
    0 = never."""
    timeline: bool = True
    """Record generation / training / sync spans per process (timeline.*.jsonl) for
    tools/plot_run.py."""
    tensorboard: bool = False
    """Mirror metrics to TensorBoard (run_dir/tensorboard; needs the tensorboard package)."""
    wandb: bool = False
    """Mirror metrics to Weights & Biases (needs the wandb package and a login)."""
    wandb_project: str | None = None
    """W&B project name; None = 'moerl'."""

    def validate(self, key: str = "telemetry") -> None:
        if self.console_level not in CONSOLE_LEVELS:
            raise ValueError(
                f"{key}.console_level={self.console_level!r} is not a log level; choose "
                f"one of {', '.join(CONSOLE_LEVELS)}"
            )
        if self.stall_warn_steps < 0:
            raise ValueError(
                f"{key}.stall_warn_steps={self.stall_warn_steps} must be >= 0 (0: never)"
            )
        if self.flip_every < 0 or self.flip_sample < 1 or self.decompose_every < 0:
            raise ValueError(
                f"{key}.flip_every={self.flip_every} must be >= 0 and "
                f"{key}.flip_sample={self.flip_sample} >= 1"
            )
