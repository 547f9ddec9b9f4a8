"""The engine stops on every EOS id SGLang stops on: config.json's, generation_config.json's
and the tokenizer's, when all three differ."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest
from engine_http import Http, InProcessEngine

CONFIG_EOS, GENERATION_EOS, TOKENIZER_EOS = [10, 11], 12, 2  # "<eos>" of the tiny tokenizer
NOT_EOS = 13


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, tmp_path_factory) -> Iterator[InProcessEngine]:
    path = tmp_path_factory.mktemp("eos") / "qwen3_moe"
    shutil.copytree(tiny_checkpoints["qwen3_moe"], path)
    for name, eos in (("config.json", CONFIG_EOS), ("generation_config.json", GENERATION_EOS)):
        body = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**body, "eos_token_id": eos}))
    eng = InProcessEngine(path)
    yield eng
    eng.close()


def test_the_scheduler_gets_the_union(engine):
    assert engine.state.scheduler.eos == {*CONFIG_EOS, GENERATION_EOS, TOKENIZER_EOS}


@pytest.mark.parametrize("token", [*CONFIG_EOS, GENERATION_EOS, TOKENIZER_EOS])
def test_each_eos_stops_the_generation(engine, token):
    out = _forced(engine, token)
    assert out["output_ids"] == [token]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}


def test_another_token_does_not_stop_it(engine):
    out = _forced(engine, NOT_EOS)
    assert out["output_ids"] == [NOT_EOS] * 3
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def _forced(engine: InProcessEngine, token: int) -> dict:
    """Generate with ``token`` forced by a logit bias at every step."""
    params = {"max_new_tokens": 3, "temperature": 0, "logit_bias": {str(token): 100.0}}
    r = Http(engine.url).post("/generate", {"input_ids": [5, 6], "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()
