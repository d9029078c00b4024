"""A byte-level walk over a context blob, for the checks decoders cannot make (float width, bigint form).

Decoders turn float 32 into a double and bigints into integers, so CTX-8 and CTX-10 are checked on
the encoded bytes. The walk assumes a blob the reference reader has already accepted.
"""

from __future__ import annotations

import struct

INT_MIN = -(1 << 63)
INT_MAX = (1 << 64) - 1

# first byte -> (length bytes of a following size, kind) for the variable-length types
_SIZED = {
    0xC4: (1, "bin"), 0xC5: (2, "bin"), 0xC6: (4, "bin"),
    0xC7: (1, "ext"), 0xC8: (2, "ext"), 0xC9: (4, "ext"),
    0xD9: (1, "str"), 0xDA: (2, "str"), 0xDB: (4, "str"),
    0xDC: (2, "array"), 0xDD: (4, "array"), 0xDE: (2, "map"), 0xDF: (4, "map"),
}  # fmt: skip
_FIXED = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xCB: 8}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}


class _Walk:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.problems: list[tuple[str, str]] = []

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def item(self) -> None:
        b = self.take(1)[0]
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            return
        if 0x80 <= b <= 0x8F:
            self.items(2 * (b & 0x0F))
        elif 0x90 <= b <= 0x9F:
            self.items(b & 0x0F)
        elif 0xA0 <= b <= 0xBF:
            self.take(b & 0x1F)
        elif b == 0xCA:
            self.take(4)
            self.problems.append(("CTX-8", f"float 32 at byte {self.pos - 5}"))
        elif b in _FIXED:
            self.take(_FIXED[b])
        elif b in _FIXEXT:
            self.ext(_FIXEXT[b])
        elif b in _SIZED:
            width, kind = _SIZED[b]
            n = int.from_bytes(self.take(width), "big")
            if kind in ("bin", "str"):
                self.take(n)
            elif kind == "ext":
                self.ext(n)
            else:
                self.items(n * (2 if kind == "map" else 1))
        else:
            raise ValueError(f"byte {b:#04x} at {self.pos - 1} starts no msgpack value")

    def items(self, n: int) -> None:
        for _ in range(n):
            self.item()

    def ext(self, n: int) -> None:
        (code,) = struct.unpack("b", self.take(1))
        payload = self.take(n)
        if code == 1:
            value = int.from_bytes(payload, "big", signed=True)
            magnitude = value if value >= 0 else ~value
            if len(payload) != (magnitude.bit_length() + 8) // 8 or INT_MIN <= value <= INT_MAX:
                self.problems.append(("CTX-10", f"bigint {value} is not minimal or fits a msgpack int"))
        elif code == 2:
            inner = _Walk(payload)
            inner.item()
            self.problems += inner.problems


def encoding_problems(data: bytes) -> list[tuple[str, str]]:
    """(requirement ID, message) for every float 32 and every non-canonical bigint in a blob."""
    walk = _Walk(data)
    walk.item()
    return walk.problems
