"""Hydra config groups for moerl, installed as `moerl.conf` (`pkg://moerl.conf`).

YAML here only selects and overrides; the schemas live in `moerl.config`.
"""
