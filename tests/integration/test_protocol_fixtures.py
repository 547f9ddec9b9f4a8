"""The recorded wire-format examples (tests/fixtures/protocol) still describe the engine:
same status, same keys, same value types; the client decodes the recorded routes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "protocol"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))


def _shape(value):  # type: ignore[no-untyped-def]
    """Keys and value types, recursively (lists by their first element)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def test_fixtures_exist():
    assert {"generate_routed_masked", "error_unknown_sampling_param", "model_info"} <= set(NAMES)


@pytest.fixture(scope="module")
def live(tiny_checkpoints, engine_factory) -> dict:
    """One fresh recording from a live engine (same tool that wrote the fixtures)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from record_protocol_fixtures import record

    eng = engine_factory(tiny_checkpoints["deepseek_moe"], "--enable-return-routed-experts")
    return record(eng.url)


@pytest.mark.parametrize("name", NAMES)
def test_engine_still_answers_like_the_fixture(name, live):
    fixture = json.loads((FIXTURES / f"{name}.json").read_text())
    assert live[name]["status"] == fixture["status"]
    assert _shape(live[name]["response"]) == _shape(fixture["response"])


def test_recorded_routes_decode_with_the_client():
    from moerl.rollout.decode import decode_routed_experts

    example = json.loads((FIXTURES / "generate_routed_masked.json").read_text())
    meta = example["response"]["meta_info"]
    prompt, out = example["request"]["input_ids"], example["response"]["output_ids"]
    rows = len(prompt) + len(out) - 1
    routes = decode_routed_experts(meta["routed_experts"], rows=rows, num_layers=4, topk=4)
    assert routes.shape == (len(prompt) + len(out) - 1, 4, 4)
    assert not routes[:, 0].any() and np.all((routes[:, 1:] >= 0) & (routes[:, 1:] < 8))
