"""A group option chosen on the command line wins over a recipe (moerl.config.recipe): the
keys a recipe sets for a group it selects travel with that choice, and a command line that
chooses a group whose keys stay in the recipe is refused (through the launcher's entry:
tests/unit/test_preflight.py)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from moerl.config.recipe import check_recipe_choices, load_recipe, recipe_names, split_recipe
from moerl.config.store import CONFIG_GROUPS, register_configs

RECIPES = recipe_names()
STALENESS = ["correct", "custom", "depth", "drop", "sync"]


@pytest.fixture(scope="module")
def hydra_ready() -> Iterator[None]:
    register_configs()
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        yield


def _group(overrides: list[str], group: str) -> object:
    """The group's node of a composition, interpolations unresolved."""
    node = OmegaConf.select(compose("config", overrides=overrides), group.replace("/", "."))
    return OmegaConf.to_container(node, resolve=False)


@functools.cache
def _alone(group: str, option: str) -> object:
    """The group's node when ``option`` is chosen without a recipe (the reference every
    recipe's composition is compared with; composed once per option)."""
    return _group([f"{group}={option}"], group)


def _options(group: str) -> list[str]:
    """The options a user picks from (not the schemas, not the recipes' derived options)."""
    loader = GlobalHydra.instance().config_loader()
    names = loader.get_group_options(group)
    return [n for n in names if not n.startswith("base_") and "_for_" not in n]


def test_staleness_options_are_the_shipped_set(hydra_ready) -> None:
    assert _options("staleness") == STALENESS


@pytest.mark.parametrize("recipe", RECIPES)
def test_staleness_choice_wins_over_every_recipe(hydra_ready, recipe: str) -> None:
    """`+recipe=R staleness=S` runs option S as shipped; sync is max_staleness 0 (the
    recipes once set max_staleness 1 over it)."""
    for option in STALENESS:
        overrides = [f"+recipe={recipe}", f"staleness={option}"]
        check_recipe_choices(overrides, CONFIG_GROUPS)
        assert _group(overrides, "staleness") == _alone("staleness", option)
    sync = compose("config", overrides=[f"+recipe={recipe}", "staleness=sync"]).staleness
    assert (sync.name, sync.max_staleness, sync.throttle) == ("depth", 0, True)


def _travelling_groups(recipe: str) -> list[str]:
    return sorted(load_recipe(recipe).options)


@pytest.mark.parametrize(
    ("recipe", "group"),
    [(r, g) for r in RECIPES for g in _travelling_groups(r)],
)
def test_a_recipes_group_keys_leave_with_its_choice(hydra_ready, recipe: str, group: str) -> None:
    """Every option of a group the recipe sets keys of composes as that option alone when
    chosen on the command line, the recipe's own choice included."""
    for option in _options(group):
        overrides = [f"+recipe={recipe}", f"{group}={option}"]
        check_recipe_choices(overrides, CONFIG_GROUPS)
        assert _group(overrides, group) == _alone(group, option), option


def test_the_recipe_still_sets_its_groups_keys(hydra_ready) -> None:
    cfg = compose("config", overrides=["+recipe=guess_number"])
    assert (cfg.env.hi, cfg.algo.credit, cfg.algo.turn_discount) == (9, "turn", 0.9)
    assert cfg.algo.loss.name == "ppo_clip"  # grpo's own nested choice is kept
    cfg = compose("config", overrides=["+recipe=guess_number", "algo=dapo"])
    assert (cfg.algo.credit, cfg.algo.loss.eps_high) == ("outcome", 0.28)
    cfg = compose("config", overrides=["+recipe=guess_number", "algo/loss=sapo"])
    assert (cfg.algo.credit, cfg.algo.loss.name) == ("turn", "sapo")


@pytest.mark.parametrize("recipe", RECIPES)
def test_choosing_a_group_the_recipe_keeps_keys_of_is_refused(recipe: str) -> None:
    """Every recipe x every group: refused exactly when the recipe's own keys (those that do
    not travel with a choice: trainer, rollout) would land on the chosen option."""
    kept = {k for k in load_recipe(recipe).node if k != "defaults"}
    for group in CONFIG_GROUPS:
        overrides = [f"+recipe={recipe}", f"{group}=default"]
        if group not in kept:
            check_recipe_choices(overrides, CONFIG_GROUPS)
            continue
        with pytest.raises(ValueError) as info:
            check_recipe_choices(overrides, CONFIG_GROUPS)
        message = str(info.value)
        assert f"{group}=default on the command line" in message and f"+recipe={recipe}" in message
        assert f"leave out {group}=default" in message


def test_the_refusal_names_the_keys_and_the_users_own_win() -> None:
    overrides = ["+recipe=deepseek_moe", "trainer=default"]
    with pytest.raises(ValueError) as info:
        check_recipe_choices(overrides, CONFIG_GROUPS)
    assert "trainer.lr=0.005" in str(info.value) and "trainer.train_iters=40" in str(info.value)
    keys = ["trainer.lr=1e-3", "trainer.lr_warmup_steps=0", "trainer.train_iters=40"]
    keys += ["trainer.global_batch_size=32", "trainer.adam_eps=1e-8"]
    with pytest.raises(ValueError) as info:
        check_recipe_choices([*overrides, *keys[:-1]], CONFIG_GROUPS)
    assert "sets trainer.adam_eps=1e-06, which" in str(info.value)  # the one key left
    check_recipe_choices([*overrides, *keys], CONFIG_GROUPS)  # every key is the user's


def test_a_nested_groups_keys_travel_apart_from_the_enclosing_group() -> None:
    node = OmegaConf.create(
        {
            "defaults": [{"override /algo": "grpo"}, {"override /algo/loss": "ppo_clip"}],
            "algo": {"credit": "turn", "loss": {"eps_high": 0.3}},
            "trainer": {"lr": 0.1},
        }
    )
    assert isinstance(node, DictConfig)
    recipe = split_recipe("mine", node)
    assert recipe.options["algo/loss"][0] == "ppo_clip_for_mine"
    assert OmegaConf.to_container(recipe.options["algo/loss"][1]) == {
        "defaults": ["ppo_clip", "_self_"],
        "eps_high": 0.3,
    }
    assert OmegaConf.to_container(recipe.options["algo"][1]) == {
        "defaults": ["grpo", "_self_"],
        "credit": "turn",
    }
    assert OmegaConf.to_container(recipe.node) == {
        "defaults": [
            {"override /algo": "grpo_for_mine"},
            {"override /algo/loss": "ppo_clip_for_mine"},
        ],
        "trainer": {"lr": 0.1},
    }
