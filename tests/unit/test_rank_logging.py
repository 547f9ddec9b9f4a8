"""A rank's log records: all of them to run_dir/logs/rankN.log, telemetry.console_level
and above to the console."""

from __future__ import annotations

import logging

import pytest

from moerl.config.schema import MoerlConfig
from moerl.telemetry.logs import hold_console, setup_rank_logging


@pytest.fixture
def root_logging():
    """Restore the root logger's handlers and level after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)


def test_info_goes_to_the_file_only(tmp_path, capsys, root_logging):
    path = setup_rank_logging(tmp_path, 1)
    assert path == tmp_path / "logs" / "rank1.log"
    lib = logging.getLogger("megatron.core.optimizer")
    lib.info("Setting up optimizer")
    lib.warning("grad norm is nan")
    logging.getLogger("httpx").info("HTTP Request: POST /generate")
    err = capsys.readouterr().err
    assert "grad norm is nan" in err and "Setting up optimizer" not in err
    text = path.read_text()
    assert "[megatron.core.optimizer][INFO] - Setting up optimizer" in text
    assert "grad norm is nan" in text and "HTTP Request" not in text


def test_console_level_info_brings_info_back(tmp_path, capsys, root_logging):
    setup_rank_logging(tmp_path, 0, "info")
    logging.getLogger("megatron.core").info("Number of buckets: 1")
    assert "Number of buckets: 1" in capsys.readouterr().err


def test_hold_console_keeps_file_handlers(tmp_path, root_logging):
    root = logging.getLogger()
    console, to_file = logging.StreamHandler(), logging.FileHandler(tmp_path / "launch.log")
    root.addHandler(console)
    root.addHandler(to_file)
    hold_console("warning")
    assert console.level == logging.WARNING and to_file.level == logging.NOTSET


def test_unknown_console_level_is_a_config_error():
    cfg = MoerlConfig()
    cfg.telemetry.console_level = "loud"
    with pytest.raises(ValueError, match="telemetry.console_level='loud'"):
        cfg.telemetry.validate()
