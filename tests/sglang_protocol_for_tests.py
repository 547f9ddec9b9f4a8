"""Validate response bodies against SGLang 0.5.23's own pydantic models
(``sglang/srt/entrypoints/openai/protocol.py``) in a fresh interpreter, so that importing
sglang (which patches transformers) stays out of the test session; skips without sglang
(tests/integration/test_engine_openai.py, tests/unit/test_engine_tool_calls.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

NO_SGLANG = 3
_CODE = f"""
import json, sys
try:
    from sglang.srt.entrypoints.openai import protocol
except ImportError as err:
    print(err)
    sys.exit({NO_SGLANG})
for name, body in json.load(sys.stdin):
    getattr(protocol, name).model_validate(body)
"""


def validate_with_sglang(payloads: list[tuple[str, dict[str, Any]]]) -> None:
    """Each ``(model name, body)`` must validate as that SGLang model."""
    done = subprocess.run(
        [sys.executable, "-c", _CODE],
        input=json.dumps(payloads),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == NO_SGLANG:
        pytest.skip(f"SGLang's protocol module is not importable: {done.stdout.strip()}")
    assert done.returncode == 0, done.stderr[-4000:]
