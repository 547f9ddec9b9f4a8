"""What the installed torch was built for, read without importing it.

``import torch`` takes about a second on a laptop. The launcher starts the embedded
engines before it imports torch, so their start (mostly their own imports) overlaps its
own; yet the engines' CPU threads depend on whether CUDA is present. A CPU-only build of
torch (``torch.version.cuda`` and ``torch.version.hip`` both None, as in the ``+cpu``
wheels) cannot see a GPU, and its ``version.py`` says so without loading the library.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

GPU_FIELDS = ("cuda", "hip")
"""The fields of ``torch/version.py`` that name the GPU toolkit a build was made with."""


def _version_fields(path: Path) -> dict[str, object] | None:
    """The constant assignments of a ``torch/version.py``; None where it is unreadable."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    fields: dict[str, object] = {}
    for node in tree.body:
        target = getattr(node, "target", None) or next(iter(getattr(node, "targets", [])), None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            fields[target.id] = value.value
    return fields


def cpu_only_build() -> bool:
    """Whether the installed torch is a CPU-only build, so that it sees no CUDA device.
    False where that cannot be told (torch missing, its version.py unreadable or
    without the fields): the caller then asks torch itself."""
    torch = sys.modules.get("torch")
    if torch is not None:
        version = torch.version
        return all(getattr(version, field, "?") is None for field in GPU_FIELDS)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    fields = _version_fields(Path(next(iter(spec.submodule_search_locations))) / "version.py")
    if fields is None or any(field not in fields for field in GPU_FIELDS):
        return False
    return all(fields[field] is None for field in GPU_FIELDS)
