"""Every tool README.md names (`python tools/….py`, `python -m moerl.engine`, and the
launcher's `--help`) starts and prints its usage with `--help`: a renamed script or a
broken import shows here. The launch commands themselves are dry-run in
tests/unit/test_docs_commands.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_tools() -> list[str]:
    text = (ROOT / "README.md").read_text()
    tools = re.findall(r"python (tools/[\w/]+\.py)", text)
    tools += re.findall(r"python (-m moerl\.(?:engine|launch)) ", text)
    return list(dict.fromkeys(tools))


def test_readme_names_tools() -> None:
    tools = readme_tools()
    assert "tools/convert_checkpoint.py" in tools and "-m moerl.engine" in tools


@pytest.mark.parametrize("tool", readme_tools())
def test_tool_help(tool: str, tmp_path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, *(str(ROOT / w) if w.startswith("tools/") else w for w in tool.split()), "--help"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower() or "Usage" in proc.stdout, proc.stdout[:500]
    assert list(tmp_path.iterdir()) == [], f"{tool} --help wrote files"
