"""Register moerl's config schemas and recipes in Hydra's ConfigStore.

Schemas: `base_config` (MoerlConfig) and one `base_<group>` per group, which the
YAML options in `conf/<group>/` name first in their defaults list so that Hydra
type-checks them and rejects unknown keys. The algorithm slots (`algo/advantage`,
`algo/loss`, `correction`) have one schema per built-in, `base_<name>`
(moerl.algo.config.register_algo_configs).

Recipes: every `recipes/NAME.yaml` (installed as the package `moerl.recipes`) is
stored as the option NAME of the group `recipe`, so `+recipe=NAME` works the same
from a wheel and from an editable install; the keys of each group a recipe selects are
stored as a derived option of that group (moerl.config.recipe), so that a group option
chosen on the command line replaces them. (Hydra reads `pkg://moerl.conf` through
`importlib.resources`, which cannot see a folder that lives outside `conf/` in an
editable install; the ConfigStore can.)
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from moerl.algo.config import AlgoConfig, register_algo_configs
from moerl.algo.correction_config import CorrectionConfig
from moerl.config.buffer import BufferConfig, StalenessConfig, register_buffer_configs
from moerl.config.engine import EngineConfig
from moerl.config.env import EnvConfig, register_env_configs
from moerl.config.eval import EvalConfig
from moerl.config.help import register_help_resolver
from moerl.config.launcher import LauncherConfig
from moerl.config.lora import LoraConfig
from moerl.config.model import ModelConfig
from moerl.config.parallel import ParallelConfig
from moerl.config.recipe import RECIPE_GROUP, load_recipe, recipe_names
from moerl.config.reward_model import RewardModelConfig
from moerl.config.rollout import RolloutConfig
from moerl.config.run_stamp import register_stamp_resolver
from moerl.config.schema import MoerlConfig
from moerl.config.sync import SyncConfig
from moerl.config.task import TaskConfig, register_task_configs
from moerl.config.trainer import TrainerConfig

GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "trainer": TrainerConfig,
    "engine": EngineConfig,
    "launcher": LauncherConfig,
    "algo": AlgoConfig,
    "correction": CorrectionConfig,
    "buffer": BufferConfig,
    "staleness": StalenessConfig,
    "sync": SyncConfig,
    "task": TaskConfig,
    "env": EnvConfig,
    "rollout": RolloutConfig,
    "lora": LoraConfig,
    "reward_model": RewardModelConfig,
    "eval": EvalConfig,
}
# Every group a command line can choose an option of: GROUP_SCHEMAS's, and the nested slots.
CONFIG_GROUPS = (*GROUP_SCHEMAS, "algo/advantage", "algo/loss", "buffer/sampling")


def register_recipes(cs: ConfigStore) -> list[str]:
    """Store each shipped recipe as an option of the `recipe` group, and the options its
    group keys travel with (moerl.config.recipe); return the recipes' names."""
    names = recipe_names()
    for name in names:
        recipe = load_recipe(name)
        for group, (option, node) in recipe.options.items():
            cs.store(group=group, name=option, node=node, provider="moerl")
        cs.store(
            group=RECIPE_GROUP, name=name, node=recipe.node, package="_global_", provider="moerl"
        )
    return names


def share_config_store() -> None:
    """Let a deep copy of Hydra's ConfigStore singleton be the singleton itself.

    Hydra 1.3 deep-copies its config repository for every composition and, in
    ``--help``, for every group it lists (``CachingConfigRepository``), and the copy
    reached the whole ConfigStore through ``StructuredConfigSource.store``: 36 ms of
    every 250 ms compose here, and 154 copies (5.5 s) in ``python -m moerl.launch
    --help``. A copy never needs its own store: ``ConfigStore.load`` already hands out
    a copy of each node, and Hydra's main branch (pull request 2928) drops the stored
    reference for ``ConfigStore.instance()``, which this matches."""
    if "__deepcopy__" not in vars(ConfigStore):
        ConfigStore.__deepcopy__ = _the_store_itself  # type: ignore[attr-defined]


def _the_store_itself(store: ConfigStore, memo: dict[int, object]) -> ConfigStore:
    return store


_REGISTERED: list[int] = []
"""``id`` of the ConfigStore repository ``register_configs`` last filled (empty: none)."""


def register_configs() -> None:
    """Register all schemas, recipes and the `--help` resolver; safe to call any number of
    times. The registration runs once per store: the schemas and the shipped recipes do
    not change within a process, and storing them again cost half of every composition
    (0.25 of 0.47 s); a store emptied or replaced since (``base_config`` gone) is
    filled again."""
    share_config_store()
    register_help_resolver()
    register_stamp_resolver()
    cs = ConfigStore.instance()
    if _REGISTERED == [id(cs.repo)] and "base_config.yaml" in cs.repo:
        return
    _REGISTERED[:] = []
    cs.store(name="base_config", node=MoerlConfig, provider="moerl")
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema, provider="moerl")
    register_algo_configs(cs)
    register_buffer_configs(cs)
    register_task_configs(cs)
    register_env_configs(cs)
    register_recipes(cs)
    _REGISTERED.append(id(cs.repo))
