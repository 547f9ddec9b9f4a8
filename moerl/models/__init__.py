"""Model building (``gpt.py``) and model families (``registry.py``, one folder each).

A family outside moerl: see ``moerl.models.registry``.
"""

from moerl.models.registry import (
    ModelFamily,
    family_for_model_type,
    family_names,
    get_family,
    register_family,
)

__all__ = [
    "ModelFamily",
    "family_for_model_type",
    "family_names",
    "get_family",
    "register_family",
]
