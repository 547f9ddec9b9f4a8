"""Issue 31: started from a folder holding a ``moerl/`` directory (a clone's parent), the
name ``moerl`` is a namespace package and ``moerl/__init__.py`` never runs. The engine's
version string must not depend on it (its /server_info answered 500), and the launcher and
engine say what shadows what."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import moerl
from moerl._version import __version__, shadowing

PROBE = (
    "import moerl, moerl.engine.native.info as info; from moerl._version import shadowing; "
    "print(info.VERSION); print(moerl.__file__); print(shadowing())"
)


def test_a_moerl_folder_in_the_working_directory_is_named_and_harmless(tmp_path):
    (tmp_path / "moerl").mkdir()
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    version, file, why = out.stdout.strip().splitlines()
    assert version.startswith(f"moerl {__version__} embedded engine")
    assert file == "None"  # the namespace package: the case under test
    assert str(tmp_path / "moerl") in why and "shadows the installed package" in why


def test_the_installed_package_is_not_shadowed_and_has_one_version():
    assert shadowing() is None
    assert moerl.__version__ == __version__ == importlib.metadata.version("moerl")
