"""Crash, power-loss, fault-injection and corruption harnesses (issue 9).

Each harness is a plain function returning a record of its counts: the pytest versions run it at a
small size, ``scripts/reliability.py`` at the published size, and publishes the figures.
"""

from __future__ import annotations

import os

FULL_ENV = "CKPTFMT_RELIABILITY"


def full() -> bool:
    """Whether the pytest versions run at the published sizes (``CKPTFMT_RELIABILITY=full``), not CI's."""
    return os.environ.get(FULL_ENV) == "full"


def size(ci: int, published: int) -> int:
    return published if full() else ci
