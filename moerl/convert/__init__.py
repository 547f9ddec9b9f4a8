"""HF ⇄ Megatron conversion: layout-free loading and streaming export through each
family's declarative map (``moerl.models.maps``); see ``loader.py`` and ``exporter.py``."""

from moerl.convert.exporter import export_hf
from moerl.convert.hf_io import CheckpointError, HFCheckpoint
from moerl.convert.loader import LoadReport, check_config, load_hf

__all__ = ["CheckpointError", "HFCheckpoint", "LoadReport", "check_config", "export_hf", "load_hf"]
