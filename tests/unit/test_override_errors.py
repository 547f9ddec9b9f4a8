"""Issue 31: a bad override in a dry run says why (``trainer.lr=abc`` printed only
"Error merging override"), and a mistyped key gets the nearest keys of the config."""

from __future__ import annotations

import pytest

import moerl.launch as launch


def _dry_run_error(capsys, *overrides: str) -> str:
    with pytest.raises(SystemExit) as stop:
        launch.dry_run(["+recipe=deepseek_moe", *overrides, "launcher.dry_run=true"])
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_a_bad_value_says_why(capsys):
    err = _dry_run_error(capsys, "trainer.lr=abc")
    assert "Error merging override trainer.lr=abc" in err
    assert "could not be converted to Float" in err and "$VALUE" not in err


def test_a_mistyped_key_gets_the_nearest_keys(capsys):
    err = _dry_run_error(capsys, "rollout.temprature=0.7", "trainer.train_iters=3")
    assert "Could not override 'rollout.temprature'" in err
    assert "did you mean: rollout.temperature" in err


def test_a_layout_bigger_than_the_world_says_how_to_start_more_ranks(capsys, monkeypatch):
    """Issue 31: ``parallel=ep2`` on the default single rank named only the divisibility."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        launch.dry_run(["+recipe=deepseek_moe", "parallel=ep2", "launcher.dry_run=true"])
    err = capsys.readouterr().err
    assert "needs at least 2 ranks" in err and "launcher.nproc=2" in err
    assert "torchrun --nproc-per-node 2" in err


def test_a_bad_target_is_reported_once(caplog):
    """Issue 31: hydra.utils logged "Error getting callable" before moerl's own message."""
    from moerl.common.registry import Registry

    registry: Registry = Registry("thing", "algo.thing")
    with pytest.raises(ValueError, match=r"algo.thing._target_='mylab.nope.fn' could not be"):
        registry.build({"_target_": "mylab.nope.fn"})
    assert not [r for r in caplog.records if "Error getting callable" in r.getMessage()]


def test_a_missing_extra_is_one_line_not_a_traceback(capsys, monkeypatch, tmp_path):
    """Issue 31: task=dataset without `datasets` printed a 30-line traceback."""
    import sys

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises
    err = _dry_run_error(capsys, "task=dataset", f"task.path={data}")
    assert (
        err.strip()
        == "moerl: missing package: task=dataset needs HF datasets: pip install 'moerl[data]'"
    )
