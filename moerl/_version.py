"""moerl's version, importable even when ``moerl/__init__.py`` is not run (a folder named
``moerl`` in the working directory makes ``moerl`` a namespace package; the installed
modules below it still load), and the check that says so."""

from __future__ import annotations

import sys

__version__ = "0.1.0"


def shadowing() -> str | None:
    """Why ``moerl`` is not the installed package (a message naming both places), or None."""
    package = sys.modules.get("moerl")
    if package is None or getattr(package, "__file__", None):
        return None
    where = [str(p) for p in getattr(package, "__path__", [])]
    real = sys.modules[__name__].__file__ or "?"
    return (
        f"'moerl' is imported as a namespace package from {where}: a folder named moerl in "
        f"the working directory (or earlier on sys.path) shadows the installed package "
        f"({real.rsplit('/', 1)[0]}). moerl runs, but run it from another directory"
    )
