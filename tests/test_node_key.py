"""Node keys: gathered through ckptfmt.decide (a malformed key fails every rank at once, naming the rank), and the
ranks of one node prove that they share its memory directory (red-team 3, finding 12)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from rank_threads import run_ranks

from ckptfmt.collective import ThreadCollective
from ckptfmt.errors import CheckpointError, MalformedMessageError, StorageError, UsageError
from ckptfmt.tier.binding import NODE_KEY_ENV
from ckptfmt.tier.nodes import PROOF_PREFIX, NodeMap
from ckptfmt.tier.ring import MemoryTier

TIMEOUT = 120.0  # long: every outcome below is reached by a broadcast, never by a timeout (the messages say which)


# ---------------------------------------------------------------- the node map


def test_every_rank_gets_every_rank_s_node() -> None:
    out = run_ranks(3, lambda _, c: NodeMap.gather(c, "AAB"[c.rank]), TIMEOUT)
    assert out == [NodeMap(nodes=("A", "A", "B"))] * 3


@pytest.mark.parametrize("garbage", [b"\xffnot json", b'{"ok": 5}', b'{"ok": ""}', b"[" * 10_000, b'{"ok": ["A"]}'])
def test_a_malformed_node_key_fails_every_rank_at_once_naming_the_rank(garbage: bytes) -> None:
    def body(_: int, c: ThreadCollective) -> Any:
        if c.rank == 1:  # a buggy or lying process: its own bytes in the gather, then the decision like any rank
            c.gather(garbage, dst=0)
            return c.broadcast(None, src=0)
        return NodeMap.gather(c, "A")

    out = run_ranks(3, body, TIMEOUT)
    for rank in (0, 2):
        exc = out[rank]
        assert isinstance(exc, MalformedMessageError), out
        assert "the node map" in str(exc) and "rank 1" in str(exc) and "within" not in str(exc), out
    assert b"rank 1" in out[1]  # the refusal reached rank 1 too


def test_an_oversized_node_key_is_refused_before_it_is_parsed() -> None:
    out = run_ranks(2, lambda _, c: NodeMap.gather(c, "A" if c.rank == 0 else "B" * (1 << 20)), TIMEOUT)
    assert all(isinstance(e, CheckpointError) and "rank 1" in str(e) and "within" not in str(e) for e in out), out


# ---------------------------------------------------------------- one node, one memory directory


def prove(tmp: Path, nodes: tuple[str, ...], dirs: tuple[str, ...]) -> list[Any]:
    """Every rank makes its run directory in ``tmp / dirs[rank]`` and proves it shares its node's."""
    nmap = NodeMap(nodes=nodes)

    def body(_: int, c: ThreadCollective) -> Any:
        tier = MemoryTier(tmp / dirs[c.rank], "/tmp/ckptfmt-node-key-run")
        tier.ensure()
        nmap.prove_shared(c, tier.root)
        return tier.root

    return run_ranks(len(nodes), body, TIMEOUT)


def test_ranks_of_one_node_key_in_different_memory_directories_are_refused_at_construction(tmp_path: Path) -> None:
    out = prove(tmp_path, ("host/boot", "host/boot"), ("shm0", "shm1"))
    messages = {str(e) for e in out}
    assert len(messages) == 1, out  # one error, on every rank
    for exc in out:
        assert isinstance(exc, UsageError), out
        text = str(exc)
        assert NODE_KEY_ENV in text and "'host/boot'" in text and "within" not in text
        assert str(tmp_path / "shm0") in text and str(tmp_path / "shm1") in text  # each rank's directory
        assert "ranks 0, 1 report node key" in text and "the file rank 0 wrote" in text and "not in rank 1's" in text
    for shm in ("shm0", "shm1"):  # the proof is gone
        assert not [n for n in os.listdir(next((tmp_path / shm).iterdir())) if n.startswith(PROOF_PREFIX)]


def test_ranks_of_one_node_sharing_its_directory_pass_and_leave_nothing(tmp_path: Path) -> None:
    out = prove(tmp_path, ("A", "A", "B", "B", "B"), ("a", "a", "b", "b", "b"))
    assert all(isinstance(r, Path) for r in out), out
    for root in {out[0], out[2]}:
        assert os.listdir(root) == []


def test_only_the_ranks_that_do_not_share_are_named(tmp_path: Path) -> None:
    out = prove(tmp_path, ("A", "A", "A", "B"), ("a", "a", "elsewhere", "b"))
    for exc in out:
        assert isinstance(exc, UsageError), out
        assert str(exc).count("ranks 0, 1, 2 report node key 'A'") == 1 and "is not in rank 2's" in str(exc)
        assert "'B'" not in str(exc)


def test_one_rank_a_node_proves_nothing(tmp_path: Path) -> None:
    assert all(isinstance(r, Path) for r in prove(tmp_path, ("A", "B"), ("a", "b")))
    NodeMap(nodes=("A",)).prove_shared(None, tmp_path)  # one rank: nothing to prove


def test_a_leader_that_cannot_write_fails_every_rank(tmp_path: Path) -> None:
    nmap = NodeMap(nodes=("A", "A"))

    def body(_: int, c: ThreadCollective) -> Any:
        nmap.prove_shared(c, tmp_path / "absent")  # the leader cannot write there
        return True

    out = run_ranks(2, body, TIMEOUT)
    for exc in out:
        assert isinstance(exc, StorageError) and "rank 0" in str(exc) and "within" not in str(exc), out


def test_a_forged_proof_name_never_leads_a_rank_out_of_its_directory(tmp_path: Path) -> None:
    from ckptfmt.tier.nodes import _sees_proof

    (tmp_path / "secret").write_text("x" * 32)
    root = tmp_path / "root"
    root.mkdir()
    assert not _sees_proof(str(root), "../secret")
    assert not _sees_proof(str(root), "0" * 32)  # not written
    (root / (PROOF_PREFIX + "0" * 32)).symlink_to(tmp_path / "secret")
    assert not _sees_proof(str(root), "0" * 32)  # never through a link
