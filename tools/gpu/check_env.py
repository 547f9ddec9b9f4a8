"""What the GPU machine's environment holds, for tools/gpu/run.py.

    python check_env.py SITE     # every wheel installed in SITE has its requirements
    python check_env.py --probe  # one line: python, torch, CUDA, GPU, moerl's location

Requirement checking reads each distribution's ``Requires-Dist`` (markers evaluated,
extras skipped), and moerl's own ``install_requires`` in setup.py (the checkout is not
installed there, so nothing else would read them), against what ``importlib.metadata``
finds on sys.path, which includes SITE through PYTHONPATH. It exits 1 listing what is
missing or too old, so a wheel left out of tools/gpu/wheels.txt shows in install.log
instead of as an ImportError mid-part.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def setup_requires(setup: Path = REPO / "setup.py") -> list[str]:
    """setup.py's ``install_requires`` strings, read without running it."""
    for node in ast.walk(ast.parse(setup.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(item) for item in node.value.elts]  # type: ignore[attr-defined]
    raise ValueError(f"{setup} has no install_requires list")


def _unmet(owner: str, texts: list[str]) -> list[str]:
    from packaging.requirements import Requirement

    found = []
    for text in texts:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            found.append(f"{owner} needs {req}: not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            found.append(f"{owner} needs {req}: found {have}")
    return found


def problems(site: Path) -> list[str]:
    found = _unmet("moerl (setup.py)", setup_requires())
    for dist in md.distributions(path=[str(site)]):
        found += _unmet(dist.metadata["Name"], list(dist.requires or []))
    return found


def probe() -> str:
    import torch

    import moerl
    import moerl.kernels

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"python {platform.python_version()} torch {torch.__version__} "
        f"cuda_available={torch.cuda.is_available()} gpu={gpu} "
        f"moerl={Path(moerl.__file__).parent} kernels={Path(moerl.kernels.__file__).parent}"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        print(probe())
        sys.exit(0)
    missing = problems(Path(sys.argv[1]))
    for line in missing:
        print(line)
    print(f"requirements: {len(missing)} problem(s)")
    sys.exit(1 if missing else 0)
