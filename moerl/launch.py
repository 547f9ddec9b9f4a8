"""The moerl entry point: `python -m moerl.launch [+recipe=NAME] [key=value ...]`.

Composes the config from `pkg://moerl.conf` (and a recipe, if given), validates it
once for this job's world size, and starts the roles. `--help` lists the config
groups and the composed config; `--cfg job` prints the config without running.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from moerl.config.store import register_configs
from moerl.config.validate import validate_config

register_configs()


@hydra.main(config_path="pkg://moerl.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        typed = validate_config(cfg)
    except ValueError as err:
        # A user error: one readable line, no traceback, non-zero exit.
        print(f"moerl: invalid config: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(OmegaConf.to_yaml(cfg, resolve=True), end="")
    print(f"moerl: config is valid for world size {typed.launcher.world_size()}.")
    print("moerl: the training loop is not implemented yet (a later issue); nothing was started.")


if __name__ == "__main__":
    main()
