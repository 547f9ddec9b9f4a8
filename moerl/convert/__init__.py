"""HF ⇄ Megatron conversion: declarative maps per family, layout-free loading and
streaming export (see ``loader.py`` and ``exporter.py``)."""

from moerl.convert.exporter import export_hf
from moerl.convert.hf_io import CheckpointError, HFCheckpoint
from moerl.convert.loader import LoadReport, check_config, load_hf

__all__ = ["CheckpointError", "HFCheckpoint", "LoadReport", "check_config", "export_hf", "load_hf"]
