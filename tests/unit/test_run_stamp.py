"""The default run directory's stamp (moerl/config/run_stamp.py): torchrun's workers take
their agent's start time, so every rank of one launch names the same directory (they
made two, a second apart, with Hydra's ${now:})."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = "from moerl.config.run_stamp import stamp; print(stamp('%Y-%m-%d/%H-%M-%S'))"
# a stand-in agent: it starts its workers one after the other, as torchrun does
AGENT = f"""
import subprocess, sys
for _ in range(2):
    subprocess.run([sys.executable, "-c", {CHILD!r}], check=True)
from moerl.config.run_stamp import _parent_start
import os
print(_parent_start(os.getpid()).strftime('%Y-%m-%d/%H-%M-%S'))
"""


def test_torchrun_workers_share_their_agents_start_time():
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "none"}
    out = subprocess.run([sys.executable, "-c", AGENT], env=env, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    first, second, agent = out.stdout.split()
    assert first == second == agent
