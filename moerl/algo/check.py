"""The start-up check of the objective: build every slot once.

Kept apart from `config.py` because it imports the builders (`advantages.py`, `losses.py`,
`correction.py`, `offpolicy.py`), which import the option dataclasses in `config.py`. They
import torch, so they are imported when the check runs: importing this module stays cheap.
"""

from __future__ import annotations

from typing import Any

from moerl.algo.config import AlgoConfig


def check_algo_config(algo: AlgoConfig, correction: Any) -> None:
    """Build every slot once (imports user `_target_`s, checks every option's range), so a
    bad objective fails at start-up with the key that is wrong."""
    from moerl.algo.advantages import build_advantage
    from moerl.algo.correction import build_correction
    from moerl.algo.losses import build_policy_loss
    from moerl.algo.offpolicy import check_composition

    build_advantage(algo.advantage)
    build_policy_loss(algo.loss)
    algo.kl.validate("algo.kl")
    build_correction(correction)
    check_composition(algo.old_policy, algo.loss, correction)
