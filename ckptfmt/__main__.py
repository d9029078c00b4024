"""``python -m ckptfmt`` runs the ``ckpt`` command."""

# cli/ is packaged as ckptfmt.cli (see pyproject's package-dir); a source-tree mypy cannot see that mapping.
from ckptfmt.cli import main  # type: ignore[import-not-found, unused-ignore]

main()
