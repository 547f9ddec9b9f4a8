"""Process groups and parallel layouts (TP × PP × EP × ETP × DP) on CPU and GPU."""

from moerl.parallel.layout import parse_layout
from moerl.parallel.spawn import spawn
from moerl.parallel.state import destroy, init_process_group, initialize_model_parallel

__all__ = ["destroy", "init_process_group", "initialize_model_parallel", "parse_layout", "spawn"]
