"""Manifest templates (ckptfmt/manifest_template.py): filled, they give the bytes merge_results gives; a result that
does not fit gets None, never a wrong manifest."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import replace

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

import ckptfmt
from ckptfmt.blocks import Blocks
from ckptfmt.manifest_template import ManifestTemplate
from ckptfmt.plan import PlacedChunk, RankResult, merge_results
from ckptfmt.writer import CheckpointWriter

_urls = itertools.count()
METADATA = {"step": "1", "note": 'a "quoted" \\ value, ünïcode\n'}


def _result(shapes: list[tuple[int, int]], *, target: int = 1 << 20) -> RankResult:
    writer = CheckpointWriter(
        ckptfmt.open_store(f"memory://manifest-template/{next(_urls)}"), profile="weights", target_file_size=target
    )
    for i, shape in enumerate(shapes):
        writer.write_tensor("weights", f"t{i}", np.zeros(shape, np.float32))
    writer.write_context("provenance", {"created_at": "2026-01-02T03:04:05Z"})
    writer.flush()
    result = writer.result()
    writer.abort()
    return result


def _new_digests(result: RankResult) -> RankResult:
    """The same records with other digests (and other context file sizes): the next save of the same layout."""

    def digest(old: str) -> str:
        return f"{old.partition(':')[0]}:{secrets.token_hex(16)}"

    chunks = []
    for placed in result.chunks:
        chunk = placed.chunk
        blocks = chunk.blocks
        if blocks is not None:
            blocks = Blocks(size=blocks.size, digests=secrets.token_hex(len(blocks.digests) // 2))
        chunks.append(replace(placed, chunk=replace(chunk, digest=digest(chunk.digest), blocks=blocks)))
    files = tuple(replace(f, digest=digest(f.digest), size=f.size + 7) for f in result.files)
    return replace(result, chunks=tuple(reversed(chunks)), files=files)  # in another order: the workers' own


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), min_size=1, max_size=6),
    st.sampled_from([64, 1 << 16, 1 << 20]),
)
def test_a_filled_template_is_the_manifest_merge_results_builds(shapes: list[tuple[int, int]], target: int) -> None:
    first = _result(shapes, target=target)
    template = ManifestTemplate.of(merge_results([first], profile="weights", metadata=METADATA), first)
    assert template is not None
    for _ in range(3):
        later = _new_digests(first)
        metadata = {k: v + secrets.token_hex(2) for k, v in METADATA.items()}
        expected = merge_results([later], profile="weights", metadata=metadata).to_bytes()
        assert template.render(later, profile="weights", metadata=metadata) == expected


def test_a_result_that_does_not_fit_gets_none() -> None:
    first = _result([(300, 100), (3, 4)])
    template = ManifestTemplate.of(merge_results([first], profile="weights", metadata=METADATA), first)
    assert template is not None
    fits = _new_digests(first)
    assert template.render(fits, profile="weights", metadata=METADATA) is not None
    placed = fits.chunks[0]
    unfit = {
        "another profile": (fits, "training", METADATA),
        "other metadata keys": (fits, "weights", {"step": "2"}),
        "a tensor more": (replace(fits, chunks=(*fits.chunks, replace(placed, tensor="extra"))), "weights", METADATA),
        "a tensor less": (replace(fits, chunks=fits.chunks[1:]), "weights", METADATA),
        "another shape": (
            replace(fits, chunks=(replace(placed, global_shape=(1, 1)), *fits.chunks[1:])),
            "weights",
            METADATA,
        ),
        "another range": (
            replace(
                fits, chunks=(replace(placed, chunk=replace(placed.chunk, end=placed.chunk.end + 4)), *fits.chunks[1:])
            ),
            "weights",
            METADATA,
        ),
        "another algorithm": (
            replace(
                fits,
                chunks=(replace(placed, chunk=replace(placed.chunk, digest="sha256:" + "0" * 64)), *fits.chunks[1:]),
            ),
            "weights",
            METADATA,
        ),
        "a file less": (replace(fits, files=fits.files[1:]), "weights", METADATA),
        "another context": (replace(fits, contexts={}), "weights", METADATA),
        "a digest the encoder would escape": (
            replace(
                fits,
                chunks=(
                    replace(placed, chunk=replace(placed.chunk, digest=_quoted(placed.chunk.digest))),
                    *fits.chunks[1:],
                ),
            ),
            "weights",
            METADATA,
        ),
    }
    for why, (result, profile, metadata) in unfit.items():
        assert template.render(result, profile=profile, metadata=metadata) is None, why


def _quoted(digest: str) -> str:
    algorithm, _, hex_ = digest.partition(":")
    return f'{algorithm}:"{hex_[1:]}'


def test_a_writer_of_a_repeating_plan_fills_its_template() -> None:
    from ckptfmt.plan_cache import PlanCache

    cache = PlanCache()
    ids = []
    for step in range(4):
        url = f"memory://manifest-template/{next(_urls)}"
        writer = CheckpointWriter(
            ckptfmt.open_store(url), profile="weights", plan_cache=cache, metadata={"s": str(step)}
        )
        writer.write_tensor("weights", "w", np.full((300, 300), step, np.float32))
        writer.write_context("provenance", {"created_at": "2026-01-02T03:04:05Z"})
        ids.append(writer.commit())
        assert ckptfmt.verify(url).ok
    assert cache.template is not None and (cache.planned, cache.replayed) == (1, 3)
    assert len(set(ids)) == 4
    assert isinstance(PlacedChunk, type)
