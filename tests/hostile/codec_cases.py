"""The ``zstd`` codec as a fuzz target (issue 23): its frame index in the manifest and its frames on disk.

Three kinds of mutant of the zstd seed (:func:`.seeds._zstd`), all read through ``read_tensor``, ``read_slice``
and ``verify``:

- **configuration**: one chunk's ``{"name": "zstd", "configuration": ...}`` changed (``frames`` entries, their
  order and count, ``frame_bytes``, ``bytegroup``/``sign_last``, ``level``, unknown members; a tensor scaled up
  with ``frame_bytes`` so the frame count still agrees: a manifest claiming far more raw bytes than are stored);
- **frames**: bytes inside one compressed chunk changed in place, the chunk's and the file's digests then
  recomputed (mostly: so only the decoder and the frame checksums stand between the bytes and the caller) or
  left as they were; or one frame replaced by a frame of the same stored size that claims another content
  size (a decompression bomb's header), or that is valid and decodes to other bytes (*forged*);
- generic tree mutations of the checkpoint (a file deleted, truncated, a symlink, a FIFO).

Beyond the oracle's own checks, a read that returns must return the seed's values wherever the oracle can tell
(``WrongData``): a tensor whose manifest record is unchanged but for ``frames``, ``frame_bytes``, ``level`` and
digests, unless a frame was forged (then a whole read, whose chunk digest is checked, must still be right when
the digests were kept; a partial one relies on frame checksums, which a forged frame carries: spec/codecs.md).
"""

from __future__ import annotations

import copy
import json
import struct
from random import Random
from typing import Any

import numpy as np

from .mutators import BOUNDARY_INTS, dumps, flip_bits, json_special, mutate_tree
from .seeds import seeds, zstd_arrays
from .sentinel import Sandbox
from .targets import Case

MANIFEST = "manifest.json"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class WrongData(AssertionError):
    """A read returned values other than the ones written, where nothing the oracle can see explains it."""


def _manifest(tree: dict[str, Any]) -> Any:
    data = tree.get(MANIFEST)
    if not isinstance(data, bytes):
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _zstd_chunks(doc: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, record in doc["fields"]["weights"]["tensors"].items():
        for chunk in record["chunks"]:
            if chunk.get("codec", {}).get("name") == "zstd":
                out.append((name, chunk))
    return out


# ---------------------------------------------------------------- configuration


def _mutate_config(doc: Any, rng: Random) -> None:
    name, chunk = rng.choice(_zstd_chunks(doc))
    config = chunk["codec"]["configuration"]
    frames = config["frames"]
    op = rng.randrange(12)
    if op == 0:  # one frame's stored size off, the sum kept or not
        i = rng.randrange(len(frames))
        delta = rng.choice((1, -1, 7, -7, frames[i] - 1))
        frames[i] -= delta
        if rng.random() < 0.6 and len(frames) > 1:
            j = (i + 1) % len(frames)
            frames[j] += delta
    elif op == 1:
        frames.reverse() if rng.random() < 0.5 else rng.shuffle(frames)
    elif op == 2:  # one frame fewer or more, the sum kept
        if len(frames) > 1 and rng.random() < 0.5:
            frames[-2:] = [frames[-2] + frames[-1]]
        else:
            half = frames[-1] // 2
            frames[-1:] = [half, frames[-1] - half]
    elif op == 3:
        config["frames"] = rng.choice(
            ([sum(frames)], [], [0, *frames], [*frames[:-1], frames[-1] + 2**63], [float(f) for f in frames])
        )
    elif op == 4:
        frames[rng.randrange(len(frames))] = rng.choice(BOUNDARY_INTS) * rng.choice((1, -1))
    elif op == 5:  # frame_bytes
        fb = config["frame_bytes"]
        config["frame_bytes"] = rng.choice((fb + 1, fb - 1, fb - 2, fb // 2, fb * 2, 1, 0, -fb, 2**40, 2**63, 4096))
    elif op == 6:
        config["frame_bytes"] = rng.choice((str(config["frame_bytes"]), float(config["frame_bytes"]), None, True))
    elif op == 7:  # the flags: how stored bytes become raw ones
        key = rng.choice(("bytegroup", "sign_last"))
        action = rng.randrange(3)
        if action == 0:
            config[key] = not config.get(key, False)
        elif action == 1:
            config.pop(key, None)
        else:
            config[key] = rng.choice((1, 0, "true", None, [True]))
    elif op == 8:
        config[rng.choice(("level", "filter", "dictionary", "Frames"))] = json_special(rng)
    elif op == 9:  # another chunk's configuration (same tensor's other half, or another tensor's)
        other = rng.choice(_zstd_chunks(doc))[1]
        chunk["codec"] = copy.deepcopy(other["codec"])
    elif op == 10:  # the tensor claims 2**k times the raw bytes, frame_bytes scaled so the frame count agrees
        record = doc["fields"]["weights"]["tensors"][name]
        k = rng.choice((4, 12, 20, 30, 36))
        if len(record["chunks"]) == 1:
            record["shape"][0] <<= k
            chunk["shape"][0] <<= k
            config["frame_bytes"] <<= k
    else:
        chunk["codec"] = rng.choice(
            (
                {"name": "zstd"},
                {"name": "zstd", "configuration": None},
                {"name": "ZSTD", "configuration": config},
                {"name": "raw", "configuration": config},
                {"name": "raw"},
                {"name": "zstd", "configuration": {**config, "frames": {"0": frames}}},
            )
        )


# ---------------------------------------------------------------- frames on disk


def _frame_header(content_size: int | None, checksum: bool = True) -> bytes:
    """A frame header: single segment, an 8-byte content size (or none), a checksum flag."""
    if content_size is None:
        return ZSTD_MAGIC + bytes([0x00 | (0x04 if checksum else 0)]) + b"\x00"  # window descriptor
    return ZSTD_MAGIC + bytes([0xE0 | (0x04 if checksum else 0)]) + struct.pack("<Q", content_size % 2**64)


def _bomb(claimed: int | None, stored: int) -> bytes:
    """A frame header claiming ``claimed`` bytes, one RLE block of 128 KiB, a checksum; padded to ``stored``."""
    block = struct.pack("<I", (min(claimed or 1 << 17, 1 << 17) << 3) | (1 << 1) | 1)[:3] + b"\x00"
    frame = _frame_header(claimed) + block + b"\x00\x00\x00\x00"
    return (frame + b"\x00" * stored)[:stored]


def _forged(want: int, stored: int, rng: Random) -> bytes | None:
    """A valid frame of exactly ``stored`` bytes that decodes to ``want`` bytes other than the seed's: an RLE
    block, then a raw block that takes up the length left; its content checksum right."""
    import xxhash

    header = ZSTD_MAGIC + b"\xa4" + struct.pack("<H", want - 256) if 256 <= want < 65792 else None
    raw = stored - len(header or b"") - 4 - 3 - 3 - 4
    if header is None or not 0 <= raw < want:
        return None
    fill = bytes([rng.randrange(256)])
    rle = want - raw
    payload = fill * rle + rng.randbytes(raw)
    blocks = struct.pack("<I", (rle << 3) | (1 << 1))[:3] + fill + struct.pack("<I", (raw << 3) | 1)[:3]
    frame = header + blocks + payload[rle:] + struct.pack("<I", xxhash.xxh64_intdigest(payload) & 0xFFFFFFFF)
    return frame if len(frame) == stored else None


def _mutate_frames(tree: dict[str, Any], doc: Any, rng: Random) -> list[str]:
    """Change bytes of one compressed chunk in place; returns flags for the oracle ("forged", "digests-kept")."""
    from ckptfmt.digests import algorithm_of
    from ckptfmt.tree_digests import chunk_digest_of, file_digest_of

    name, chunk = rng.choice(_zstd_chunks(doc))
    path = chunk["path"]
    data = bytearray(tree[path])
    begin, end = chunk["range"]
    frames = chunk["codec"]["configuration"]["frames"]
    flags = []
    op = rng.randrange(6)
    i = rng.randrange(len(frames))
    at = begin + sum(frames[:i])
    size = frames[i]
    raw_size = int(np.prod(chunk["shape"])) * zstd_arrays()[name].dtype.itemsize
    frame_bytes = chunk["codec"]["configuration"]["frame_bytes"]
    want = min(frame_bytes, raw_size - i * frame_bytes)
    if op <= 1:
        piece = flip_bits(bytes(data[begin:end]), rng, rng.choice((1, 1, 3)))
        data[begin:end] = piece
    elif op == 2:  # the frame header: magic, descriptor, content size
        j = at + rng.randrange(min(size, 8))
        data[j] = rng.choice((0, 0xFF, data[j] ^ 0x20, data[j] ^ 0x04, data[j] ^ 0x80, rng.randrange(256)))
    elif op == 3:  # the content checksum
        j = at + size - 1 - rng.randrange(4)
        data[j] ^= 1 << rng.randrange(8)
    elif op == 4:
        claimed = rng.choice((2**40, 2**62, 2**64 - 1, want + 1, want - 1, 0, None, 1 << 30))
        data[at : at + size] = _bomb(claimed, size)
    else:
        forged = _forged(want, size, rng)
        if forged is None:
            data[at : at + size] = _bomb(want, size)
        else:
            data[at : at + size] = forged
            flags.append("forged")
    if bytes(data) == tree[path]:
        return []  # a byte set to the value it had: nothing changed
    tree[path] = bytes(data)
    if rng.random() < 0.75:  # digests recomputed: only the decoder and the frame checksums are left to refuse
        chunk["digest"] = chunk_digest_of(algorithm_of(chunk["digest"]), bytes(data[begin:end]))
        for record in doc["files"]:
            if record["path"] == path:
                record["digest"] = file_digest_of(algorithm_of(record["digest"]), bytes(data))
    else:
        flags.append("digests-kept")
    return flags


def make_zstd_case(rng: Random) -> Case:
    tree = dict(seeds()["zstd"])
    op = rng.random()
    flags: list[str] = []
    if op < 0.8:
        doc = _manifest(tree)
        assert doc is not None
        if op < 0.4:
            for _ in range(rng.choice((1, 1, 2))):
                _mutate_config(doc, rng)
        else:
            flags = _mutate_frames(tree, doc, rng)
        tree[MANIFEST] = dumps(doc).encode("utf-8", "surrogatepass")
    else:
        tree = mutate_tree(tree, rng)
    slice_seed = str(rng.randrange(1 << 30))
    return Case(tree=tree, args=("zstd", slice_seed, *flags))


# ---------------------------------------------------------------- the oracle's view


def _normalized(record: Any) -> Any:
    """A tensor record without what cannot change the values a successful read returns."""
    record = copy.deepcopy(record)
    for chunk in record.get("chunks", []) if isinstance(record, dict) else []:
        if isinstance(chunk, dict):
            chunk.pop("digest", None)
            codec = chunk.get("codec")
            config = codec.get("configuration") if isinstance(codec, dict) else None
            if isinstance(config, dict):
                for key in ("frames", "frame_bytes", "level"):
                    config.pop(key, None)
    return record


def checkable(case: Case) -> dict[str, str]:
    """Tensor name -> "all" (whole and partial reads checked) or "whole", for the tensors the oracle can tell."""
    seed_doc = _manifest(dict(seeds()["zstd"]))
    doc = _manifest(case.tree)
    if doc is None or ("forged" in case.args and "digests-kept" not in case.args):
        return {}
    try:
        tensors = doc["fields"]["weights"]["tensors"]
    except (KeyError, TypeError):
        return {}
    seed_tensors = seed_doc["fields"]["weights"]["tensors"]
    how = "whole" if "forged" in case.args else "all"
    if not isinstance(tensors, dict):
        return {}
    return {n: how for n, r in seed_tensors.items() if n in tensors and _normalized(tensors[n]) == _normalized(r)}


def _same(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()


def read_zstd(case: Case, box: Sandbox | None) -> None:
    import ckptfmt

    assert box is not None
    expected = zstd_arrays()
    check = checkable(case)
    rng = Random(case.args[1])
    problems = []
    with ckptfmt.open(str(box.root)) as ckpt:
        for name in ckpt.tensor_names("weights"):
            try:
                whole = ckpt.read_tensor("weights", name)
            except ckptfmt.CheckpointError:
                whole = None
            if whole is not None and name in check and not _same(whole, expected[name]):
                problems.append(f"read_tensor({name!r})")
            shape = ckpt.tensor("weights", name).shape
            offsets = [rng.randrange(s + 1) if s else 0 for s in shape]
            extent = [rng.randrange(s - o + 1) if s - o else 0 for s, o in zip(shape, offsets, strict=True)]
            try:
                part = ckpt.read_slice("weights", name, offsets, extent)
            except ckptfmt.CheckpointError:
                part = None
            if part is not None and check.get(name) == "all":
                region = tuple(slice(o, o + e) for o, e in zip(offsets, extent, strict=True))
                if not _same(part, expected[name][region]):
                    problems.append(f"read_slice({name!r}, {offsets}, {extent})")
        report = ckpt.verify()
        if report.ok and "digests-kept" in case.args:
            problems.append("verify (compressed bytes changed under unchanged digests)")
    if problems:
        raise WrongData("returned other values than were written: " + ", ".join(problems))


def verify_zstd(case: Case, box: Sandbox | None) -> None:
    import ckptfmt

    assert box is not None
    report = ckptfmt.verify(str(box.root))
    if report.ok and "digests-kept" in case.args:
        raise WrongData("verify passed a checkpoint whose compressed bytes changed under unchanged digests")
