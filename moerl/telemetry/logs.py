"""Where a trainer rank's log records go: all of them to a file, few to the console.

Megatron-core, transformers and the HTTP client log at INFO through Python's logging
(megatron lists every parameter of every gradient bucket). On the console that buries
the lines a user watches: moerl's ``moerl: ...`` lines and the progress line, which are
plain prints and never pass through logging. So each rank sends every record at INFO
and above to ``RUN_DIR/logs/rankN.log`` and only ``telemetry.console_level`` (warning
by default) and above to stderr; Python warnings join the same records. The embedded
engines write their output to ``RUN_DIR/logs/`` too (``moerl.launch``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from moerl.config.telemetry import CONSOLE_LEVELS

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
# per-request lines, even in the file: a run makes thousands of requests
CHATTY = ("httpx", "httpcore")


def log_dir(run_dir: Path) -> Path:
    """The run directory's folder of log files."""
    return Path(run_dir) / "logs"


def rank_log_path(run_dir: Path, rank: int) -> Path:
    return log_dir(run_dir) / f"rank{rank}.log"


def to_level(console_level: str) -> int:
    if console_level not in CONSOLE_LEVELS:
        raise ValueError(f"console_level={console_level!r}; choose one of {CONSOLE_LEVELS}")
    level: int = logging.getLevelName(console_level.upper())
    return level


def hold_console(console_level: str) -> None:
    """Raise the console handlers of the root logger to ``console_level``. Hydra's job
    logging prints INFO in the launching process (a torchrun rank, until
    ``setup_rank_logging``); its launch.log in the run directory keeps everything."""
    level = to_level(console_level)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):  # a FileHandler is a StreamHandler
            handler.setLevel(level)


def setup_rank_logging(run_dir: Path, rank: int, console_level: str = "warning") -> Path:
    """Replace the root logger's handlers (Hydra's console and launch.log, under
    torchrun) with a file handler for ``rankN.log`` at INFO (DEBUG when asked for) and a
    stderr handler at ``console_level``; returns the file's path."""
    level = to_level(console_level)
    path = rank_log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(FORMAT)
    to_file = logging.FileHandler(path)
    to_file.setLevel(min(level, logging.INFO))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level)
    for handler in (to_file, console):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(min(level, logging.INFO))
    logging.captureWarnings(True)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)
    if level > logging.INFO:
        quiet_progress_bars()
    return path


def quiet_progress_bars() -> None:
    """No tqdm bars from transformers (``Writing model shards`` when rank 0 writes the
    initial checkpoint): the console shows one progress line, moerl's."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
