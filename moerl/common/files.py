"""Small file helpers shared by the writers of checkpoints and exports."""

from __future__ import annotations

import os
from pathlib import Path


def readable(path: Path) -> None:
    """Give a written file the mode the umask allows, as ``open`` would: safetensors'
    ``save_file`` writes 0600, which other users of a shared cluster cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)
