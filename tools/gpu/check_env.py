"""What the GPU machine's environment holds, for tools/gpu/run.py.

    python check_env.py SITE     # every wheel installed in SITE has its requirements
    python check_env.py --probe  # one line: python, torch, CUDA, GPU, moerl's location

Requirement checking reads each distribution's ``Requires-Dist`` (markers evaluated,
extras skipped) against what ``importlib.metadata`` finds on sys.path, which includes
SITE through PYTHONPATH. It exits 1 listing what is missing or too old, so a wheel left
out of tools/gpu/wheels.txt shows in install.log instead of as an ImportError mid-part.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys
from pathlib import Path


def problems(site: Path) -> list[str]:
    from packaging.requirements import Requirement

    found = []
    for dist in md.distributions(path=[str(site)]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                found.append(f"{dist.metadata['Name']} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                found.append(f"{dist.metadata['Name']} needs {req}: found {have}")
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
