"""Recipes, installed as `moerl.recipes` and registered as the Hydra group `recipe`.

Each `NAME.yaml` here starts with `# @package _global_` and is selected with
`python -m moerl.launch +recipe=NAME`; see `moerl.config.store.register_configs`.
"""
