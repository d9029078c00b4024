"""The checked options of one checkpoint writer (:class:`~ckptfmt.writer.CheckpointWriter`'s constructor).

:meth:`WriteOptions.check` refuses a bad option with a :class:`~ckptfmt.errors.UsageError` before the writer
touches its store, in a fixed order (profile, sizes, digest, block size, metadata, stores, codec): the first one
wrong is the one named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .blocks import valid_size as valid_block_size
from .codecs import WriteCodec
from .collective import Collective
from .errors import UsageError
from .profiles import PROFILES
from .tree_digests import file_hasher


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteOptions:
    """A writer's options, checked: what the constructor keeps of its arguments (besides store, base, hooks)."""

    profile: str
    target_file_size: int
    digest: str
    rank: int  # the collective's rank when there is one
    workers: int
    metadata: dict[str, str]  # a copy: the caller's mapping may change after the writer starts
    # Ranks whose stores are not shared (a memory slot on each node, spec/commit.md "Several stores"): the store
    # each rank writes to, by rank; None: one store every rank sees.
    store_of_rank: tuple[int, ...] | None
    # raw chunks larger than this get a digest per block, so partial reads are verified over exactly the blocks
    # they read (spec/blocks.md); None writes none (the checkpoint stays a 1.0 or 1.1 one)
    block_bytes: int | None
    # None or "raw" stores raw chunks; "zstd" or "zstd:LEVEL" compresses floating chunks (spec/codecs.md)
    codec: WriteCodec

    @classmethod
    def check(
        cls,
        *,
        profile: str,
        target_file_size: int,
        digest: str,
        rank: int,
        workers: int,
        metadata: Mapping[str, str] | None,
        collective: Collective | None,
        codec: str | WriteCodec | None,
        store_of_rank: Sequence[int] | None,
        block_bytes: int | None,
    ) -> WriteOptions:
        """The options, or a :class:`~ckptfmt.errors.UsageError` naming the first one that is wrong."""
        if profile not in PROFILES:
            raise UsageError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
        if target_file_size <= 0 or workers < 0 or rank < 0:
            raise UsageError("target_file_size must be positive; workers and rank non-negative")
        if collective is not None and collective.rank != rank:
            rank = collective.rank
        file_hasher(digest)  # fail early on an unknown algorithm
        if block_bytes is not None and not valid_block_size(block_bytes):
            raise UsageError(f"block_bytes must be a power of two from 4096 to 2**30 (or None), got {block_bytes!r}")
        if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise UsageError("metadata must map strings to strings")
        spread = tuple(store_of_rank) if store_of_rank is not None and collective is not None else None
        if spread is not None and collective is not None and len(spread) != collective.world_size:
            raise UsageError("store_of_rank needs one entry per rank")
        return cls(
            profile=profile,
            target_file_size=target_file_size,
            digest=digest,
            rank=rank,
            workers=workers,
            metadata=dict(metadata or {}),
            store_of_rank=spread,
            block_bytes=block_bytes,
            codec=WriteCodec.parse(codec),  # refused before the base is opened
        )
