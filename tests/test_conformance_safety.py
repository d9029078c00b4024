"""The conformance runner against its own environment (issue 23): a vector tree planted in the installed
suite's cache is not used (the shipped digest decides), and no adapter process outlives its call."""

from __future__ import annotations

import io
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from ckptfmt.conformance import suite as suite_module
from ckptfmt.conformance.runner import call
from ckptfmt.conformance.session import Options, run
from ckptfmt.conformance.suite import cached_vectors, tree_digest

from ckptfmt.errors import DigestMismatchError

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "conformance" / "vectors"
DIGEST = ROOT / "conformance" / "vectors.sha256"


# ---------------------------------------------------------------- the shipped digest


def test_the_shipped_digest_is_the_committed_trees() -> None:
    assert DIGEST.read_text().strip() == tree_digest(VECTORS), "run `python -m conformance generate`"


def test_the_shipped_digest_is_what_the_generator_produces(tmp_path: Path) -> None:
    from ckptfmt.conformance.generate import generate

    generate(tmp_path / "fresh")
    assert tree_digest(tmp_path / "fresh") == DIGEST.read_text().strip()


def test_the_installed_package_ships_the_digest() -> None:
    assert suite_module.shipped_digest() == DIGEST.read_text().strip()


# ---------------------------------------------------------------- a planted cache


def copy_committed(out: Path) -> None:  # the real generator takes ~10 s and gives these bytes (test above)
    shutil.copytree(VECTORS, out, symlinks=True)


def poisoned(target: Path) -> None:
    """A tree of one invalid vector that a reader refusing everything passes."""
    vector = target / "invalid" / "anything"
    (vector / "checkpoint").mkdir(parents=True)
    (vector / "expected.json").write_text('{"requirements": ["MAN-1"], "outcome": "rejected", "scope": "reader"}')
    (target / "valid").mkdir()


def cache_target(root: Path) -> Path:
    import ckptfmt

    return root / f"vectors-{ckptfmt.__version__}-{suite_module._fingerprint()}"


def test_a_poisoned_cache_is_regenerated_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptfmt.conformance.generate.generate", copy_committed)
    target = cache_target(tmp_path)
    poisoned(target)
    got = cached_vectors(tmp_path)
    assert got == target and tree_digest(got) == DIGEST.read_text().strip()
    assert not (got / "invalid" / "anything").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # the planted tree is gone


def test_a_symlinked_cache_entry_is_replaced_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptfmt.conformance.generate.generate", copy_committed)
    elsewhere = tmp_path / "elsewhere"
    poisoned(elsewhere)
    (tmp_path / "cache").mkdir()
    cache_target(tmp_path / "cache").symlink_to(elsewhere)
    got = cached_vectors(tmp_path / "cache")
    assert not got.is_symlink() and tree_digest(got) == DIGEST.read_text().strip()
    assert (elsewhere / "invalid" / "anything").is_dir()  # the link was removed, not what it points at


def test_a_poisoned_cache_cannot_pass_a_reader_that_refuses_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTFMT_CONFORMANCE_CACHE", str(tmp_path))
    monkeypatch.setattr("ckptfmt.conformance.suite.VECTORS", tmp_path / "no-checkout")  # as installed
    monkeypatch.setattr("ckptfmt.conformance.generate.generate", copy_committed)
    poisoned(cache_target(tmp_path))
    refuse = tmp_path / "refuse.sh"
    refuse.write_text("#!/bin/sh\necho 'MAN-1: refused' >&2\nexit 1\n")
    refuse.chmod(0o755)
    out, err = io.StringIO(), io.StringIO()
    status = run(Options(reader=str(refuse), only=("valid/weights", "anything")), out, err)
    assert status == 1 and "0 passed, 1 failed" in out.getvalue(), out.getvalue() + err.getvalue()


def test_a_generated_tree_without_the_shipped_digest_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTFMT_CONFORMANCE_CACHE", str(tmp_path))
    monkeypatch.setattr("ckptfmt.conformance.suite.VECTORS", tmp_path / "no-checkout")
    monkeypatch.setattr("ckptfmt.conformance.generate.generate", poisoned)
    with pytest.raises(DigestMismatchError):
        cached_vectors(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing left to be picked up later
    out, err = io.StringIO(), io.StringIO()
    assert run(Options(reader="false"), out, err) == 2
    assert "cannot use the conformance vectors" in err.getvalue()


# ---------------------------------------------------------------- adapter processes


def adapter(tmp_path: Path, body: str) -> list[str]:
    """A shell adapter that starts a background child, writes its pid, then runs ``body``; the child writes
    ``child.finished`` if it lives out its 100 s, the adapter ``body.finished`` if ``body`` ends without exiting."""
    script = tmp_path / "adapter.sh"
    child = f'(sleep 100; touch "{tmp_path}/child.finished") &\necho $! > "{tmp_path}/child.pid"'
    script.write_text(f'#!/bin/sh\n{child}\n{body}\ntouch "{tmp_path}/body.finished"\n')
    script.chmod(0o755)
    return [str(script)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for init to reap it is not running
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_dead(pid: int, seconds: float = 60.0) -> bool:
    """Whether ``pid`` is dead or a zombie, polled for at most ``seconds`` (a hang guard: SIGKILL is at once)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("body", ["sleep 300", "exit 0", "exit 1"])
def test_no_adapter_process_outlives_its_call(tmp_path: Path, body: str) -> None:
    ex = call(adapter(tmp_path, body), timeout=2)
    # the call waited out neither the adapter's 300 s body nor its child's 100 s: it killed them (its timeout, 2 s,
    # for the body; the group kill once the adapter answered, for the child)
    assert not (tmp_path / "child.finished").exists(), "the call waited for the adapter's child to end"
    assert not (tmp_path / "body.finished").exists(), "the call waited out the adapter's body"
    child = int((tmp_path / "child.pid").read_text())
    try:
        assert wait_dead(child), "the adapter's child is still running"
    finally:
        if alive(child):  # and its sleep: the adapter's whole group
            os.killpg(os.getpgid(child), signal.SIGKILL)
    assert ex.status == (None if body.startswith("sleep") else int(body.split()[1]))
