"""Cache keys that follow the code: a hash of the sources of the kernels a task runs (a task's own
source, Prefect's ``TASK_SOURCE``, does not cover the kernels it calls)."""

from __future__ import annotations

import functools
import hashlib
import importlib
from pathlib import Path


@functools.lru_cache(maxsize=None)
def sources_sha256(*packages: str) -> str:
    """Hex SHA-256 of the ``*.py`` files of the named packages (e.g. ``"paperline.kernels.video"``),
    in name order; computed once per process."""
    h = hashlib.sha256()
    for name in packages:
        for f in sorted(Path(importlib.import_module(name).__file__).parent.glob("*.py")):
            h.update(f"{name}/{f.name}".encode() + f.read_bytes())
    return h.hexdigest()
