"""examples/torchft_train.py with one fault hook for tests: ``--flip-first-offer`` flips a byte of the checkpoint
this group first offers to a healing peer (its memory snapshot, or the snapshot of its live state when the memory
tier does not hold the step yet: a bit flipped in node memory), so that the heal must be refused and retried, and
the bad byte never loaded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torchft_train

from ckptfmt.tier.heal_server import Offer
from ckptfmt.torch.ft_transport import CkptfmtTransport


class FlippingTransport(CkptfmtTransport):  # type: ignore[misc]
    flipped = False

    def _training_offer(self, step: int, key: str, ft_state: dict[str, int]) -> Offer:
        offer = super()._training_offer(step, key, ft_state)
        if not self.flipped:
            self.flipped = True
            root = Path(offer.source.url)
            data = sorted(p for p in root.rglob("*.safetensors"))[0]
            raw = bytearray(data.read_bytes())
            raw[-1] ^= 0x01
            with open(data, "r+b") as f:  # in place, as a bit flips in memory
                f.seek(len(raw) - 1)
                f.write(bytes(raw[-1:]))
            print(f"flipped the last byte of {data}", flush=True)
        return offer


def main() -> None:
    argv = sys.argv[1:]
    flip = "--flip-first-offer" in argv
    argv = [a for a in argv if a != "--flip-first-offer"]

    def factory(manager: Any, state: Any, args: Any) -> CkptfmtTransport:
        kind = FlippingTransport if flip else CkptfmtTransport
        return kind(manager=manager, state=state, host=args.host, timeout=torchft_train.TIMEOUT)

    torchft_train.main(argv, transport_factory=factory)


if __name__ == "__main__":
    main()
