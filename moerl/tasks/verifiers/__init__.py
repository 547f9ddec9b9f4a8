"""Verifiers: reward functions that check a completion's content, registered in REWARDS.

    math           math-verify equivalence of the final answer (`math_answer.py`;
                   needs `pip install moerl[verify]`)
    format_length  a required pattern and a length budget (`format_length.py`)
    code           the completion's program run against tests in a sandboxed subprocess
                   (`code.py`, the sandbox in `sandbox.py`)

Each is picked by `task.reward=NAME` with options in `task.reward_options`. A check that
fails (timeout, crash, no answer) scores 0 and says why in traj.meta["reward_reason"]; it
never raises into the orchestrator.
"""

from moerl.tasks.verifiers import code, format_length, math_answer

__all__ = ["code", "format_length", "math_answer"]
