"""Rollouts: the Trajectory record, the async engine client, response decoding."""

from moerl.common.trajectory import Trajectory, load_jsonl, save_jsonl
from moerl.rollout.client import ENGINE_URL_KEY, EngineClient
from moerl.rollout.errors import EngineError, RoutedExpertsMissing, SamplingMaskMissing

__all__ = [
    "ENGINE_URL_KEY",
    "EngineClient",
    "EngineError",
    "RoutedExpertsMissing",
    "SamplingMaskMissing",
    "Trajectory",
    "load_jsonl",
    "save_jsonl",
]
