"""The checkout's ``kernels/`` directory (installed as ``moerl.kernels``) does not stand in
for an installed distribution named ``kernels``: transformers 5.25 requires Hugging Face's
and imports it, and a process started in the clone's root (``python -m moerl.launch``,
the engines it starts, CI) has that root first on ``sys.path``."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, kernels, moerl.kernels, transformers.activations
print(json.dumps({"kernels": kernels.__file__, "moerl.kernels": moerl.kernels.__file__}))
"""


def _installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_transformers_imports_in_the_clones_root():
    """In the root (``-c``: its first ``sys.path`` entry is the working directory, as with
    ``-m``) transformers imports, ``moerl.kernels`` is this checkout's, and ``kernels`` is
    the installed distribution where there is one (else this checkout's directory)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(files["moerl.kernels"]).resolve() == ROOT / "kernels" / "__init__.py"
    theirs = Path(files["kernels"]).resolve()
    if _installed():
        assert theirs != ROOT / "kernels" / "__init__.py"
    else:
        assert theirs == ROOT / "kernels" / "__init__.py"
