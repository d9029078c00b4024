"""Compare two ckptfmt checkpoints bit for bit: every tensor of every field (dtype, shape, bytes) and every
context but provenance (which records when and where it was written). Usage: ``python compare.py A B``;
exit status 1 if they differ. Needs only ckptfmt (no torch, no torchtitan)."""

from __future__ import annotations

import sys

import ckptfmt

SKIPPED_CONTEXTS = ("provenance",)


def differences(a_url: str, b_url: str) -> tuple[list[str], int]:
    """What differs between the checkpoints (empty if nothing), and how many tensors were compared."""
    problems: list[str] = []
    compared = 0
    with ckptfmt.open(a_url) as a, ckptfmt.open(b_url) as b:
        if set(a.fields) != set(b.fields):
            return [f"fields: {sorted(a.fields)} vs {sorted(b.fields)}"], 0
        for field in sorted(a.fields):
            names = a.tensor_names(field)
            if names != b.tensor_names(field):
                problems.append(f"{field}: tensor names differ")
                continue
            for name in names:
                x, y = a.read_tensor(field, name), b.read_tensor(field, name)
                compared += 1
                if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                    problems.append(f"{field}/{name}")
            if field not in SKIPPED_CONTEXTS:
                contexts = [c.read_context(field) if c.has_context(field) else None for c in (a, b)]
                if contexts[0] != contexts[1]:
                    problems.append(f"{field}: context")
    return problems, compared


def main(argv: list[str]) -> int:
    problems, compared = differences(argv[1], argv[2])
    print(f"{compared} tensors compared; differing: {', '.join(problems[:10]) or 'none'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
