"""Validation before heavy work: `moerl.launch.preflight` (what the launcher and its dry
run check before any rank starts) refuses each bad config naming the key, reading the
checkpoint's config.json and the checkpoint a resume would load."""

from __future__ import annotations

import importlib.util
import json

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig
from tiny_hf_for_tests import hf_dir as _hf_dir

from moerl import launch
from moerl.config.store import register_configs
from moerl.launch import preflight


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch) -> None:
    register_configs()
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        # fails after the model is written and the engines are up today
        (["trainer.global_batch_size=12"], ["trainer.global_batch_size=12", "group_size=8"]),
        (["trainer.save_every=-3"], ["trainer.save_every=-3", ">= 0"]),
        (["trainer.keep_checkpoints=-1"], ["trainer.keep_checkpoints=-1", ">= 0"]),
        (["trainer.lr=inf"], ["trainer.lr=inf", "finite"]),
        (["rollout.temperature=nan"], ["rollout.temperature=nan", "finite"]),
        (["sync.bucket_mb=inf"], ["sync.bucket_mb=inf", "finite"]),
        (
            ["sync.overlap=true", "parallel=pp2", "launcher.nproc=2"],
            ["sync.overlap=true", "parallel.pp=2"],
        ),
        (["engine.max_restarts=-1"], ["engine.max_restarts=-1", ">= 0"]),
        (["engine.startup_timeout_s=0"], ["engine.startup_timeout_s=0.0", "> 0"]),
        (
            ["trainer.global_batch_size=32", "buffer.max_groups=2"],
            ["buffer.max_groups=2", "4 groups", "buffer.max_groups >= 4"],
        ),
    ],
)
def test_preflight_refuses_bad_numbers(overrides, fragments) -> None:
    with pytest.raises(ValueError) as info:
        preflight(_compose(*overrides))
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["launcher.placement=nearby"], ["launcher.placement", "colocated"]),
        (
            ["launcher.placement=colocated", "engine=sglang", "engine.urls=[http://n7:30000]"],
            ["placement=colocated", "engine=sglang", "launcher.placement=disaggregated"],
        ),
        (
            ["launcher.placement=colocated", "engine.num_engines=2"],
            ["engine.num_engines=2", "engine.num_engines=1"],
        ),
        (
            ["launcher.placement=colocated", "sync.transport=broadcast"],
            ["sync.transport=broadcast", "sync.transport=auto"],
        ),
        (
            ["launcher.sleep_engine=true"],
            ["launcher.sleep_engine=true", "launcher.placement=colocated", "staleness=sync"],
        ),
        (
            ["launcher.placement=colocated", "launcher.sleep_engine=true", "staleness=depth"],
            ["launcher.sleep_engine=true", "staleness=sync"],
        ),
    ],
)
def test_preflight_refuses_what_colocation_cannot_do(overrides, fragments) -> None:
    """Refused before anything starts, each naming the setting and the fix."""
    with pytest.raises(ValueError) as info:
        preflight(_compose(*overrides))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_preflight_accepts_colocation() -> None:
    cfg = preflight(_compose("model=deepseek_moe_tiny", "launcher.placement=colocated"))
    assert cfg.launcher.placement == "colocated"


def test_preflight_needs_a_model_the_engines_can_serve() -> None:
    with pytest.raises(ValueError, match="model.family=gpt has no Hugging Face format"):
        preflight(_compose())  # the base config's model: fine for the trainer alone
    assert preflight(_compose("model=deepseek_moe_tiny")).model.family == "deepseek_moe"


def test_preflight_checks_the_checkpoints_architecture(tmp_path) -> None:
    """The configured model (8 experts) fits ep=4; the checkpoint's 6 experts do not."""
    ckpt = _hf_dir(tmp_path / "hf", num_experts=6, moe_router_num_groups=2)
    ok = ["+recipe=deepseek_moe", "parallel.ep=4", "launcher.nproc=4"]
    assert preflight(_compose(*ok)).model.num_experts == 8
    with pytest.raises(ValueError) as info:
        preflight(_compose(*ok, f"model.path={ckpt}"))
    message = str(info.value)
    assert "parallel.ep=4" in message and "num_experts=6" in message
    assert str(ckpt / "config.json") in message
    loaded = preflight(_compose(*ok[:1], f"model.path={ckpt}", "parallel.ep=2", "launcher.nproc=2"))
    assert loaded.model.num_experts == 6


def test_preflight_names_a_broken_config_json(tmp_path) -> None:
    ckpt = _hf_dir(tmp_path / "hf")
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=f"{ckpt / 'config.json'} is not valid JSON"):
        preflight(_compose("+recipe=deepseek_moe", f"model.path={ckpt}"))
    config = json.loads(text)
    del config["n_routed_experts"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json has no 'n_routed_experts'"):
        preflight(_compose("+recipe=deepseek_moe", f"model.path={ckpt}"))


def test_preflight_refuses_a_resume_with_nothing_to_resume(tmp_path) -> None:
    for folder in (tmp_path / "missing", tmp_path):
        cfg = _compose(
            "model=deepseek_moe_tiny", "trainer.resume=true", f"trainer.checkpoint_dir={folder}"
        )
        with pytest.raises(ValueError) as info:
            preflight(cfg)
        assert "trainer.resume=true" in str(info.value) and str(folder) in str(info.value)


def test_dry_run_refuses_a_group_choice_the_recipe_would_overwrite(monkeypatch, capsys) -> None:
    """Through the launcher's dry-run entry (`launcher.dry_run=true`): a recipe's keys never
    land on a group option chosen on the command line (moerl.config.recipe)."""
    with pytest.raises(SystemExit) as info:
        launch.dry_run(["+recipe=qwen3_moe", "rollout=default", "launcher.dry_run=true"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "rollout=default on the command line" in err and "rollout.max_new_tokens=8" in err
    launch.dry_run(["+recipe=qwen3_moe", "staleness=sync", "launcher.dry_run=true"])
    out = capsys.readouterr().out
    assert "max_staleness: 0" in out and "config is valid" in out


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="with transformer-engine megatron-core's MLA trains under TP",
)
def test_preflight_refuses_mla_under_tensor_parallelism() -> None:
    """Found 3.5 minutes in, after the checkpoint was written and the engines started."""
    with pytest.raises(ValueError) as info:
        preflight(_compose("+recipe=deepseek_moe", "parallel.tp=2", "launcher.nproc=2"))
    message = str(info.value)
    assert "parallel.tp=2" in message and "MLA" in message and "parallel.tp=1" in message
    gqa = preflight(_compose("+recipe=qwen3_moe", "parallel.tp=2", "launcher.nproc=2"))
    assert gqa.parallel.tp == 2


# A user's package, as a researcher writes one: each plug-in takes its input, then options.
PLUGINS = """
def correction(inp, cap=2.0, level="token"):
    raise NotImplementedError

def anything(inp, **options):
    raise NotImplementedError

def needs_k(inp, k):
    raise NotImplementedError

def advantage(inp, scale=1.0):
    raise NotImplementedError

def loss(inp, clip=0.2):
    raise NotImplementedError

def staleness(inp, slack=1):
    raise NotImplementedError

def sampling(inp, seed=0):
    raise NotImplementedError

def replay(inp, threshold=0.1):
    raise NotImplementedError

def reward(inp, weight=1.0):
    raise NotImplementedError

def make_env(prompt, max_turns=3):
    raise NotImplementedError

class Task:
    def __init__(self, tokenizer, size=4):
        raise NotImplementedError
"""


@pytest.fixture
def lab(tmp_path, monkeypatch) -> str:
    (tmp_path / "preflight_lab.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "preflight_lab"


@pytest.mark.parametrize(
    ("overrides", "key", "accepted", "close"),
    [
        (
            ["correction=custom", "correction._target_={lab}.correction"],
            "correction.options.capp",
            "cap, level",
            "cap",
        ),
        (
            ["algo/advantage=custom", "algo.advantage._target_={lab}.advantage"],
            "algo.advantage.options.scal",
            "scale",
            "scale",
        ),
        (
            ["algo/loss=custom", "algo.loss._target_={lab}.loss"],
            "algo.loss.options.clipp",
            "clip",
            "clip",
        ),
        (
            ["staleness=custom", "staleness._target_={lab}.staleness"],
            "staleness.options.slak",
            "slack",
            "slack",
        ),
        (
            ["buffer/sampling=custom", "buffer.sampling._target_={lab}.sampling"],
            "buffer.sampling.options.sed",
            "seed",
            "seed",
        ),
        (["env=custom", "env._target_={lab}.make_env"], "env.options.max_turn", "max_turns", None),
        (["task=custom", "task._target_={lab}.Task"], "task.options.sise", "size", "size"),
        (["task.reward={lab}.reward"], "task.reward_options.weigth", "weight", "weight"),
        (
            ["trainer.replay={{_target_:{lab}.replay,treshold:0.1}}"],
            "trainer.replay.treshold",
            "threshold",
            None,
        ),
    ],
)
def test_preflight_checks_a_plugins_options_against_its_signature(
    lab, overrides, key, accepted, close
) -> None:
    """A typo in a `_target_` plug-in's options failed at the first step, minutes in, with a
    TypeError from inside the trainer; preflight names the key, the target and the fix."""
    args = ["+recipe=deepseek_moe", *(o.format(lab=lab) for o in overrides)]
    if not key.startswith("trainer.replay"):
        args.append(f"+{key}=3")
    with pytest.raises(ValueError) as info:
        preflight(_compose(*args))
    message = str(info.value)
    assert f"{key} is not a parameter of" in message and f"{lab}." in message
    assert f"which takes {accepted}" in message
    if close:
        assert f"did you mean {close}?" in message


def test_preflight_accepts_a_plugins_right_options(lab) -> None:
    """The right name passes, **options takes any, a parameter without default is required."""
    base = ["+recipe=deepseek_moe", "correction=custom"]
    ok = preflight(
        _compose(*base, f"correction._target_={lab}.correction", "+correction.options.cap=3")
    )
    assert ok.correction.options == {"cap": 3}
    preflight(_compose(*base, f"correction._target_={lab}.anything", "+correction.options.capp=3"))
    with pytest.raises(
        ValueError, match=rf"correction._target_={lab}.needs_k needs the option 'k'"
    ):
        preflight(_compose(*base, f"correction._target_={lab}.needs_k"))
    preflight(_compose(*base, f"correction._target_={lab}.needs_k", "+correction.options.k=1"))
