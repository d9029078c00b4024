"""GIL-free block hashing (ckptfmt/free_hash.py): the same digests as the xxhash binding, or a clean fallback."""

from __future__ import annotations

import hypothesis.strategies as st
import xxhash
from hypothesis import given, settings

from ckptfmt import free_hash
from ckptfmt.blocks import BlockHasher


def _reference(data: bytes, size: int) -> list[str]:
    view = memoryview(data)
    return [xxhash.xxh3_128_hexdigest(view[i : i + size]) for i in range(0, len(view) - len(view) % size, size)]


def test_the_binding_s_own_function_is_found_and_checked() -> None:
    function = free_hash._xxh3()
    assert function is not None  # the xxhash wheel exports XXH3_128bits; elsewhere the fallback is taken
    # ... and its dispatching entry, twice as fast as the plain one on a CPU with AVX2 (the CI's and this one's)
    assert getattr(function, "__name__", "") == "XXH3_128bits_dispatch"


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=1 << 18), st.sampled_from([4096, 65536, 1 << 17]), st.integers(0, 5000))
def test_whole_blocks_hash_as_the_binding_does(data: bytes, size: int, skip: int) -> None:
    buffer = bytearray(data)
    at = min(skip, len(buffer))
    count = (len(buffer) - at) // size
    found = free_hash.xxh3_blocks(memoryview(buffer), at, count, size)
    assert found == "".join(_reference(bytes(buffer[at:]), size))


def test_read_only_and_strided_buffers_fall_back() -> None:
    data = bytes(range(256)) * 1024
    assert free_hash.xxh3_blocks(memoryview(data), 0, 4, 65536) is None
    strided = memoryview(bytearray(data))[::2]
    assert free_hash.xxh3_blocks(strided, 0, 1, 4096) is None


@settings(max_examples=30, deadline=None)
@given(st.binary(min_size=0, max_size=300_000), st.lists(st.integers(1, 100_000), max_size=6), st.booleans())
def test_a_block_hasher_gives_the_same_blocks_whatever_the_buffer(data: bytes, cuts: list[int], writable: bool) -> None:
    buffer: bytes | bytearray = bytearray(data) if writable else data
    view = memoryview(buffer)
    hasher = BlockHasher("xxh3-128", 65536)
    at = 0
    for cut in cuts:  # slices that cut blocks anywhere, as the writer's do
        hasher.update(view[at : at + cut])
        at = min(len(view), at + cut)
    hasher.update(view[at:])
    blocks = hasher.finish()
    expected = [xxhash.xxh3_128_hexdigest(view[i : i + 65536]) for i in range(0, len(view), 65536)]
    assert blocks.digests == "".join(expected)
