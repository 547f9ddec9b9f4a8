"""Registries, the `_target_` escape hatch, and the algo/correction config groups in Hydra."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import pytest
import torch
from configs_for_tests import compose_config
from omegaconf import OmegaConf

from moerl.algo.advantages import ADVANTAGES, build_advantage
from moerl.algo.config import (
    ADVANTAGE_OPTIONS,
    LOSS_OPTIONS,
    AdvantageConfig,
    GRPOConfig,
    PolicyLossConfig,
    RLOOConfig,
)
from moerl.algo.correction import CORRECTIONS, CorrectionInput, CorrectionOutput, build_correction
from moerl.algo.correction_config import (
    CORRECTION_OPTIONS,
    CorrectionConfig,
    CustomCorrectionConfig,
    TISConfig,
)
from moerl.algo.losses import POLICY_LOSSES, PolicyLossInput, PolicyLossOutput, build_policy_loss
from moerl.common.registry import Registry
from moerl.config.store import register_configs
from moerl.validate import validate_config

# --- user code "outside moerl": found through _target_, never registered -------------


def scaled_weights(inp: CorrectionInput, *, scale: float = 1.0) -> CorrectionOutput:
    """Weight `scale` on every counted token."""
    weights_T = torch.where(inp.loss_mask_T, scale, 0.0)
    return CorrectionOutput(weights_T=weights_T, keep_T=inp.loss_mask_T, metrics={"scale": scale})


def sum_logprob_loss(inp: PolicyLossInput) -> PolicyLossOutput:
    return PolicyLossOutput(loss=-(inp.advantages_T * inp.logprobs_T).sum())


TARGET = f"{__name__}.scaled_weights"


def _corr_inp() -> CorrectionInput:
    return CorrectionInput(
        trainer_logprobs_T=torch.zeros(3),
        rollout_logprobs_T=torch.zeros(3),
        loss_mask_T=torch.tensor([True, False, True]),
        seq_ids_T=torch.tensor([0, 0, 0]),
        num_seqs=1,
    )


@pytest.mark.parametrize(
    "spec",
    [
        {"_target_": TARGET, "scale": 3.0},
        {"_target_": TARGET, "options": {"scale": 3.0}},
        OmegaConf.create({"_target_": TARGET, "scale": 3.0}),
        CustomCorrectionConfig(_target_=TARGET, options={"scale": 3.0}),
    ],
)
def test_target_escape_hatch(spec) -> None:
    out = build_correction(spec)(_corr_inp())
    assert out.weights_T.tolist() == [3.0, 0.0, 3.0]
    assert "scaled_weights" not in CORRECTIONS


def test_target_in_another_slot() -> None:
    fn = build_policy_loss({"_target_": f"{__name__}.sum_logprob_loss"})
    logp = torch.tensor([-1.0, -2.0])
    inp = PolicyLossInput(
        logp,
        logp,
        torch.tensor([1.0, 1.0]),
        torch.tensor([True, True]),
        torch.zeros(2, dtype=torch.int64),
        1,
    )
    assert fn(inp).loss.item() == 3.0


def test_bad_target_names_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"correction._target_='no_such_pkg.fn' could not be imported"
    ):
        build_correction({"_target_": "no_such_pkg.fn"})
    with pytest.raises(ValueError, match=r"correction._target_ is empty"):
        build_correction(CustomCorrectionConfig())


# --- the Registry itself ------------------------------------------------------------


@dataclass
class _Opts:
    name: str = "double"
    factor: float = 2.0


def _fresh() -> Registry[float, float]:
    reg: Registry[float, float] = Registry("thing", "slot")

    @reg.register("double", _Opts)
    def double(x: float, cfg: _Opts) -> float:
        return x * cfg.factor

    return reg


def test_registry_build_forms() -> None:
    reg = _fresh()
    assert reg.names() == ["double"]
    assert reg.build("double")(3.0) == 6.0
    assert reg.build(_Opts(factor=5.0))(3.0) == 15.0
    assert reg.build({"name": "double", "factor": 0.5})(3.0) == 1.5
    assert reg.get("double")(1.0, _Opts()) == 2.0
    assert reg.config_type("double") is _Opts


def test_registry_errors() -> None:
    reg = _fresh()
    with pytest.raises(ValueError, match=r"slot: unknown thing 'tripple'; known: double"):
        reg.build("tripple")
    with pytest.raises(ValueError, match=r"slot.factr is not an option of thing 'double'"):
        reg.build({"name": "double", "factr": 1.0})
    with pytest.raises(ValueError, match=r"slot needs 'name'"):
        reg.build({"factor": 1.0})
    with pytest.raises(ValueError, match="already registered"):
        reg.register("double", _Opts)(lambda x, cfg: x)
    with pytest.raises(TypeError, match="dataclass"):
        reg.register("plain", dict)
    with pytest.raises(TypeError, match="cannot build"):
        reg.build(42)


def test_bare_base_means_defaults_and_mismatch_is_refused() -> None:
    # AdvantageConfig(name="rloo") is the slot base: RLOO with its (no) options.
    fn = build_advantage(AdvantageConfig(name="rloo"))
    assert isinstance(fn.keywords["cfg"], RLOOConfig)
    # GRPO's options renamed to rloo: refused rather than silently dropping them.
    with pytest.raises(
        ValueError, match=r"algo.advantage.name='rloo' but its options are a GRPOConfig"
    ):
        build_advantage(GRPOConfig(name="rloo"))


@pytest.mark.parametrize(
    "registry, options, folder",
    [
        (ADVANTAGES, ADVANTAGE_OPTIONS, "algo/advantage"),
        (POLICY_LOSSES, LOSS_OPTIONS, "algo/loss"),
        (CORRECTIONS, CORRECTION_OPTIONS, "correction"),
    ],
)
def test_every_builtin_has_a_schema_and_a_yaml(registry, options, folder) -> None:
    assert sorted(options) == sorted([*registry.names(), "custom"])
    for name in registry.names():
        assert registry.config_type(name) is options[name]
        assert registry.config_type(name)().name == name
    root = resources.files("moerl.conf").joinpath(folder)
    shipped = sorted(e.name[: -len(".yaml")] for e in root.iterdir() if e.name.endswith(".yaml"))
    assert shipped == sorted(options)


# --- Hydra: the groups compose, validate and build -----------------------------------


@pytest.fixture(autouse=True, scope="module")
def _registered() -> None:
    register_configs()


def _yaml_options(folder: str) -> list[str]:
    root = resources.files("moerl.conf").joinpath(folder)
    return sorted(e.name[: -len(".yaml")] for e in root.iterdir() if e.name.endswith(".yaml"))


OVERRIDES = (
    [f"algo={n}" for n in _yaml_options("algo")]
    + [f"algo/advantage={n}" for n in _yaml_options("algo/advantage") if n != "custom"]
    + [f"algo/loss={n}" for n in _yaml_options("algo/loss") if n != "custom"]
    + [f"correction={n}" for n in _yaml_options("correction") if n != "custom"]
)


@pytest.mark.parametrize("override", OVERRIDES)
def test_option_composes_validates_and_builds(override: str) -> None:
    typed = validate_config(compose_config(override), world_size=1)
    build_advantage(typed.algo.advantage)
    build_policy_loss(typed.algo.loss)
    build_correction(typed.correction)


def test_base_config_objective() -> None:
    typed = validate_config(compose_config(), world_size=1)
    assert (typed.algo.advantage.name, typed.algo.loss.name, typed.correction.name) == (
        "grpo",
        "ppo_clip",
        "none",
    )


def test_presets_set_their_knobs() -> None:
    dapo = validate_config(compose_config("algo=dapo"), world_size=1).algo.loss
    assert (dapo.eps_low, dapo.eps_high, dapo.agg) == (0.2, 0.28, "token_mean")
    tis = validate_config(
        compose_config("correction=tis", "correction.cap=3"), world_size=1
    ).correction
    assert tis == TISConfig(cap=3.0)


def test_norm_length_from_the_generation_budget() -> None:
    # Dr. GRPO's L_max is the generation budget: interpolate it rather than repeat it.
    typed = validate_config(
        compose_config(
            "rollout.max_new_tokens=512",
            "algo.loss.agg=seq_mean_token_sum_norm",
            "algo.loss.norm_length=${rollout.max_new_tokens}",
        ),
        world_size=1,
    )
    assert typed.algo.loss.norm_length == 512
    build_policy_loss(typed.algo.loss)


def test_custom_correction_from_the_command_line() -> None:
    cfg = compose_config(
        "correction=custom", f"correction._target_={TARGET}", "+correction.options.scale=3"
    )
    typed = validate_config(cfg, world_size=1)
    assert build_correction(typed.correction)(_corr_inp()).weights_T.tolist() == [3.0, 0.0, 3.0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["correction=mis", "correction.high=0.1"], "correction.high=0.1 must be > 0.5"),
        (["correction=tis", "correction.level=seq"], "correction.level='seq' is not supported"),
        (["correction=tis", "correction.low=3"], "correction.low=3.0 must be < correction.cap=2.0"),
        (["correction=opsm", "correction.delta=-1"], "correction.delta=-1.0 must be >= 0.0"),
        (["algo.loss.agg=sum"], "algo.loss.agg='sum' is not supported"),
        (["algo.loss.dual_clip=0.5"], "algo.loss.dual_clip=0.5 must be > 1.0"),
        (
            ["algo.loss.agg=seq_mean_token_sum_norm"],
            "algo.loss.norm_length=0 must be > 0 with algo.loss.agg='seq_mean_token_sum_norm'",
        ),
        (["algo.kl.agg=seq_mean_token_sum_norm"], "algo.kl.norm_length=0 must be > 0"),
        (["algo/loss=sapo", "algo.loss.tau_neg=0"], "algo.loss.tau_neg=0.0 must be > 0.0"),
        (["algo/loss=gmpo", "algo.loss.clip_low=-1"], "algo.loss.clip_low=-1.0 must be >= 0.0"),
        (["algo.kl.kind=k5"], "algo.kl.kind='k5' is not supported"),
        (["correction=custom"], "correction._target_ is empty"),
        (
            ["algo.advantage.name=rloo"],
            "algo.advantage.name='rloo' but its options are a GRPOConfig",
        ),
        (["correction.name=nope"], "correction: unknown correction 'nope'; known: icepop, mis"),
        (["correction=tis", "+correction.capp=3"], "correction.capp is not a config key"),
    ],
)
def test_bad_objective_fails_validation(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        validate_config(compose_config(*overrides), world_size=1)
    assert message in str(info.value)


# --- what the trainer's start-up check reads: reweights, ratio_loss -----------------


@pytest.mark.parametrize(
    "override, reweights",
    [
        ("correction=none", False),
        ("correction=tis", True),
        ("correction=mis", True),
        ("correction=icepop", True),
        ("correction=topr", True),
        ("correction=version_gap", False),
        ("correction=opsm", False),
        (["correction=mis", "correction.reweight=false"], False),
        (["correction=icepop", "correction.reweight=false"], False),
        (["correction=custom", f"correction._target_={TARGET}"], True),
        (
            ["correction=custom", f"correction._target_={TARGET}", "correction.reweights=false"],
            False,
        ),
    ],
)
def test_correction_reweights(override, reweights: bool) -> None:
    overrides = [override] if isinstance(override, str) else override
    typed = validate_config(compose_config(*overrides), world_size=1)
    assert typed.correction.reweights is reweights


def test_reweights_of_a_bare_base_is_that_of_its_name() -> None:
    assert CorrectionConfig().reweights is False
    assert CorrectionConfig(name="tis").reweights is True
    assert CorrectionConfig(name="version_gap").reweights is False
    assert CorrectionConfig(name="nope").reweights is False


def test_custom_reweights_is_not_passed_to_the_function() -> None:
    # A mapping spec may carry the declaration; it is not a keyword of the function.
    fn = build_correction({"_target_": TARGET, "scale": 2.0, "reweights": True})
    assert fn(_corr_inp()).weights_T.tolist() == [2.0, 0.0, 2.0]


@pytest.mark.parametrize(
    "overrides, ratio_loss",
    [
        (["algo/loss=ppo_clip"], True),
        (["algo/loss=gspo"], True),
        (["algo/loss=cispo"], True),
        (["algo/loss=reinforce"], False),
        (["algo/loss=sapo"], True),
        (["algo/loss=gmpo"], True),
        (["algo/loss=custom", f"algo.loss._target_={__name__}.sum_logprob_loss"], True),
        (
            [
                "algo/loss=custom",
                f"algo.loss._target_={__name__}.sum_logprob_loss",
                "algo.loss.ratio_loss=false",
            ],
            False,
        ),
    ],
)
def test_policy_loss_ratio_loss(overrides: list[str], ratio_loss: bool) -> None:
    typed = validate_config(compose_config(*overrides), world_size=1)
    assert typed.algo.loss.ratio_loss is ratio_loss


def test_ratio_loss_of_a_bare_base_is_that_of_its_name() -> None:
    assert PolicyLossConfig().ratio_loss is True
    assert PolicyLossConfig(name="reinforce").ratio_loss is False
