"""Register moerl's config schemas and recipes in Hydra's ConfigStore.

Schemas: `base_config` (MoerlConfig) and one `base_<group>` per group, which the
YAML options in `conf/<group>/` name first in their defaults list so that Hydra
type-checks them and rejects unknown keys. The algorithm slots (`algo/advantage`,
`algo/loss`, `correction`) have one schema per built-in, `base_<name>`
(moerl.algo.config.register_algo_configs).

Recipes: every `recipes/NAME.yaml` (installed as the package `moerl.recipes`) is
stored as the option NAME of the group `recipe`, so `+recipe=NAME` works the same
from a wheel and from an editable install. (Hydra reads `pkg://moerl.conf` through
`importlib.resources`, which cannot see a folder that lives outside `conf/` in an
editable install; the ConfigStore can.)
"""

from __future__ import annotations

from importlib import resources

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

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
from moerl.config.reward_model import RewardModelConfig
from moerl.config.rollout import RolloutConfig
from moerl.config.schema import MoerlConfig
from moerl.config.sync import SyncConfig
from moerl.config.task import TaskConfig, register_task_configs
from moerl.config.trainer import TrainerConfig

RECIPE_PACKAGE = "moerl.recipes"
RECIPE_GROUP = "recipe"

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


def _package_header(text: str) -> str | None:
    """The `# @package X` value from the comment lines that open a YAML file."""
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not line.startswith("#"):
            return None
        body = line.lstrip("#").strip()
        if body.startswith("@package"):
            return body[len("@package") :].strip()
    return None


def register_recipes(cs: ConfigStore) -> list[str]:
    """Store each shipped recipe as an option of the `recipe` group; return their names."""
    names = []
    for entry in sorted(resources.files(RECIPE_PACKAGE).iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".yaml") or not entry.is_file():
            continue
        name = entry.name[: -len(".yaml")]
        text = entry.read_text(encoding="utf-8")
        package = _package_header(text)
        if package != "_global_":
            raise ValueError(
                f"recipes/{entry.name} must start with the line '# @package _global_' "
                f"(found package {package!r}); a recipe is a change to the whole config"
            )
        node = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
        cs.store(group=RECIPE_GROUP, name=name, node=node, package=package, provider="moerl")
        names.append(name)
    return names


def register_configs() -> None:
    """Register all schemas, recipes and the `--help` resolver; safe to call any number of times."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=MoerlConfig, provider="moerl")
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema, provider="moerl")
    register_algo_configs(cs)
    register_buffer_configs(cs)
    register_task_configs(cs)
    register_env_configs(cs)
    register_recipes(cs)
    register_help_resolver()
