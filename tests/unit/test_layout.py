"""Layout names and start-up validation of parallel layouts."""

from __future__ import annotations

import pytest

from moerl.config.parallel import ParallelConfig
from moerl.parallel.layout import parse_layout

MODEL = dict(num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=4)


@pytest.mark.parametrize(
    "name, tp, pp, ep, etp, world",
    [
        ("single", 1, 1, 1, 1, 1),
        ("tp2", 2, 1, 1, 2, 2),
        ("pp2", 1, 2, 1, 1, 2),
        ("ep2", 1, 1, 2, 1, 2),
        ("etp2ep2", 1, 1, 2, 2, 4),
        ("tp2ep2", 2, 1, 2, 2, 4),
        ("tp2etp1ep2", 2, 1, 2, 1, 2),
        ("tp2pp2", 2, 2, 1, 2, 4),
        ("dp2ep2", 1, 1, 2, 1, 4),
        ("pp2dp2", 1, 2, 1, 1, 4),
    ],
)
def test_parse_layout(name, tp, pp, ep, etp, world):
    cfg, got_world = parse_layout(name)
    assert (cfg.tp, cfg.pp, cfg.ep, cfg.expert_tp, got_world) == (tp, pp, ep, etp, world)
    assert cfg.name() in (name, "single") or name.startswith(("dp", "pp2dp", "tp2etp1"))
    cfg.validate(world, **MODEL)


@pytest.mark.parametrize("bad", ["tp2x", "tp0", "tp2tp2", "ep", "2tp"])
def test_parse_layout_rejects_bad_names(bad):
    with pytest.raises(ValueError, match="layout"):
        parse_layout(bad)


@pytest.mark.parametrize(
    "cfg, world, words",
    [
        (ParallelConfig(tp=2, pp=2), 6, ["world size 6", "tp × pp"]),
        (ParallelConfig(tp=3), 3, ["parallel.tp=3", "num_attention_heads=4", "[1, 2]"]),
        (ParallelConfig(pp=5), 5, ["parallel.pp=5", "num_layers=4"]),
        (ParallelConfig(pp=3), 3, ["parallel.pp=3", "does not divide"]),
        (ParallelConfig(ep=3), 3, ["parallel.ep=3", "num_experts=4", "[1, 2, 4]"]),
        (ParallelConfig(ep=4, etp=2), 4, ["etp × parallel.ep", "does not divide"]),
        (ParallelConfig(tp=0), 1, ["parallel.tp=0"]),
        (ParallelConfig(pp=2, virtual_pp=2), 2, ["virtual_pp=2", "not supported"]),
    ],
)
def test_invalid_layouts_fail_with_named_values(cfg, world, words):
    with pytest.raises(ValueError) as err:
        cfg.validate(world, **MODEL)
    for word in words:
        assert word in str(err.value)


def test_expert_parallel_needs_experts():
    with pytest.raises(ValueError, match="need an MoE model"):
        ParallelConfig(ep=2).validate(2, num_layers=2, num_attention_heads=4)


def test_check_parallel_rejects_bad_layout_before_spawning():
    import runpy
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "check_parallel.py"
    argv = sys.argv
    sys.argv = [str(tool), "--layouts", "pp2,ep3"]
    try:
        with pytest.raises(ValueError, match="parallel.ep=3"):
            runpy.run_path(str(tool), run_name="__main__")
    finally:
        sys.argv = argv
