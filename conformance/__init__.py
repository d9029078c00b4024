"""The ckptfmt conformance suite: committed vectors, a runner for any reader or writer, traceability.

``python -m conformance run --reader CMD`` / ``run --writer CMD`` / ``generate`` / ``check``;
the protocol is in conformance/README.md.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
VECTORS = HERE / "vectors"
SPEC = HERE.parent / "spec"
COVERAGE = HERE / "coverage.json"
