"""The store contract (ckptfmt/storage/base.py), run against every backend: one ``StoreContract`` base class whose
tests each backend's class subclasses, as zarr's ``StoreTests`` (docs/STYLE.md, principle 10).

A backend's class provides ``store`` (an empty store under test) and may override ``holding`` (a function that
puts files where the store under test reads them, and returns it: read-only wrappers get their files through
what they wrap). Tests of behaviour one backend alone has (O_DIRECT, S3's multipart uploads and checked GETs)
stay with that backend's own tests; what every store promises is here, findable by what it is.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ckptfmt.errors import (
    MissingFileError,
    SizeMismatchError,
    StorageError,
    UnsafePathError,
    UsageError,
)
from ckptfmt.storage import Store, open_store
from ckptfmt.storage.local import IN_PLACE_MARKER, LocalStore, merge_adjacent
from ckptfmt.storage.overlay import OverlayStore
from ckptfmt.storage.routed import RoutedStore
from ckptfmt.storage.slot import SlotStore
from tests.page_cache import cached_pages, evict, resident

Holding = Callable[[Mapping[str, bytes]], Store]
DATA = bytes(range(256)) * 257  # 65,792 bytes: no two neighbouring ranges alike
FILES = {"manifest.json": b"{}", "weights/r00000-00000.safetensors": DATA, "a/b/c/deep.bin": b"deep", ".hidden": b"h"}
UNSAFE = ["../escape", "/abs", "a//b", "a/./b", "a/../b", ""]


def put(store: Store, path: str, data: bytes) -> None:
    out = store.create(path)
    try:
        out.write(data)
        out.commit()
    except BaseException:
        out.abort()
        raise


def applies_when(**flags: bool) -> pytest.MarkDecorator:
    """A contract test only for backends whose class flags have these values: the others do not collect it
    (tests/conftest.py deselects it), rather than skipping a test that cannot apply to them."""
    return pytest.mark.applies_when(**flags)


class StoreContract:
    """What every Store promises. Subclasses set the class flags where their backend differs; the flags that
    are capabilities are checked against the store's own (test_the_declared_capabilities_are_the_stores)."""

    writable = True  # False: a read-only view; every write is refused with UsageError
    in_place = False  # True: create() writes under the final name (memory-tier slots), not published on commit
    listing_view = False  # True: answers only the paths listed when it was made (overlay); others are missing
    local = True  # capabilities.local: a filesystem (paths, symlinks, special files)
    exclusive_create = True  # capabilities.exclusive_create: put_exclusive is atomic under a race

    def test_the_declared_capabilities_are_the_stores(self, store: Store) -> None:
        caps = store.capabilities
        assert (caps.local, caps.exclusive_create) == (self.local, self.exclusive_create)

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        raise NotImplementedError  # each backend's class provides it
        yield

    @pytest.fixture
    def holding(self, store: Store) -> Holding:
        def make(files: Mapping[str, bytes]) -> Store:
            for path, data in files.items():
                put(store, path, data)
            return store

        return make

    # ------------------------------------------------------------ reading

    def test_reads_what_was_written(self, holding: Holding) -> None:
        store = holding(FILES)
        for path, data in FILES.items():
            assert store.read(path) == data
            assert store.size(path) == len(data)
            assert store.exists(path)

    def test_lists_every_file_hidden_and_nested_with_its_size(self, holding: Holding) -> None:
        store = holding(FILES)
        assert store.list() == {p: len(d) for p, d in FILES.items()}
        detail = store.list_detail()
        assert {p: f.size for p, f in detail.items()} == store.list()
        assert all(f.kind is None for f in detail.values())  # regular files, all of them
        assert store.is_directory()

    def test_an_empty_root_lists_nothing_and_is_no_directory(self, holding: Holding) -> None:
        store = holding({})
        assert store.list() == {} and store.list_detail() == {}
        assert not store.is_directory()

    def test_an_empty_file(self, holding: Holding) -> None:
        store = holding({"empty": b""})
        assert store.read("empty") == b"" and store.size("empty") == 0
        assert store.list() == {"empty": 0}
        store.read_ranges("empty", [(0, memoryview(bytearray(0)))])
        assert store.mapping("empty") is None

    def test_a_missing_file_is_a_missing_file_error(self, holding: Holding) -> None:
        store = holding({"there": b"x"})
        for call in (
            lambda: store.read("absent"),
            lambda: store.size("absent"),
            lambda: store.read_into("absent", 0, memoryview(bytearray(1))),
            lambda: store.read_ranges("absent", [(0, memoryview(bytearray(1)))]),
            lambda: store.read("no/such/dir/file"),
        ):
            with pytest.raises(MissingFileError) as info:
                call()
            assert isinstance(info.value, FileNotFoundError) and info.value.code == "missing_file"
        assert not store.exists("absent") and not store.exists("no/such/dir/file")

    def test_read_is_bounded_before_reading(self, holding: Holding) -> None:
        store = holding({"doc.json": b"12345"})
        with pytest.raises(SizeMismatchError, match=r"doc\.json"):
            store.read("doc.json", max_size=4)
        assert store.read("doc.json", max_size=5) == b"12345"

    def test_read_into_fills_from_an_offset(self, holding: Holding) -> None:
        store = holding({"f": DATA})
        for begin, length in ((0, 10), (1000, 4096), (len(DATA) - 7, 7)):
            out = bytearray(length)
            store.read_into("f", begin, memoryview(out))
            assert out == DATA[begin : begin + length]
        wide = memoryview(bytearray(16)).cast("I")  # any format: filled as bytes
        store.read_into("f", 4, wide)
        assert wide.tobytes() == DATA[4:20]

    def test_read_ranges_fills_every_view_in_any_order(self, holding: Holding) -> None:
        store = holding({"f": DATA})
        # back to back (one run), a gap, overlapping, out of order, empty, and a run split into many views
        spans = [(100, 30000), (0, 100), (40000, 3), (40003, 25000), (50000, 64), (7, 0), (60000, 5792)]
        spans += [(30100 + 100 * i, 100) for i in range(50)]
        views = [(begin, memoryview(bytearray(length))) for begin, length in spans]
        store.read_ranges("f", views, keep_cached=False)
        for begin, view in views:
            assert view.tobytes() == DATA[begin : begin + len(view)], begin

    def test_reading_past_the_end_is_a_size_mismatch(self, holding: Holding) -> None:
        store = holding({"f": b"0123456789"})
        with pytest.raises(SizeMismatchError):
            store.read_into("f", 5, memoryview(bytearray(6)))
        with pytest.raises(SizeMismatchError):
            store.read_ranges("f", [(0, memoryview(bytearray(4))), (8, memoryview(bytearray(4)))])

    def test_a_mapping_is_the_file_or_none(self, holding: Holding) -> None:
        store = holding({"f": DATA})
        mapped = store.mapping("f")
        if mapped is not None:
            assert mapped[:] == DATA
            mapped.close()

    def test_modification_times_are_seconds_since_the_epoch_where_known(self, holding: Holding) -> None:
        store = holding({"f": b"x"})
        mtime = store.list_detail()["f"].mtime
        # seconds (not milliseconds, not a naive local time's offset): between 2020 and 2100
        assert mtime is None or 1_577_836_800 < mtime < 4_102_444_800

    # ------------------------------------------------------------ writing

    @applies_when(writable=False)
    def test_a_read_only_store_refuses_every_write(self, store: Store) -> None:
        for call in (
            lambda: store.create("f"),
            lambda: store.put_exclusive("f", b"x"),
            lambda: store.delete("f"),
        ):
            with pytest.raises(UsageError):
                call()

    @applies_when(writable=True)
    def test_a_file_appears_whole_on_commit(self, store: Store) -> None:
        out = store.create("weights/f.bin")
        out.write(DATA[:1000])
        out.write(memoryview(DATA)[1000:])
        if not self.in_place:
            assert not store.exists("weights/f.bin")
        out.commit()
        assert store.read("weights/f.bin") == DATA
        assert store.list() == {"weights/f.bin": len(DATA)}  # no temp file left behind

    @applies_when(writable=True)
    def test_commit_replaces_an_old_file_never_truncating_it(self, store: Store) -> None:
        put(store, "f", DATA)
        out = store.create("f")
        out.write(b"short")
        if not self.in_place:
            assert store.read("f") == DATA  # the old file, whole, until the new one is committed
        out.commit()
        assert store.read("f") == b"short" and store.size("f") == 5

    @applies_when(writable=True)
    def test_abort_leaves_nothing_and_is_idempotent(self, store: Store) -> None:
        out = store.create("weights/f.bin")
        out.write(DATA)
        out.abort()
        out.abort()
        assert not store.exists("weights/f.bin")
        assert store.list() == {}
        assert store.pending_uploads() == []

    @applies_when(writable=True)
    def test_put_exclusive_creates_once(self, store: Store) -> None:
        store.put_exclusive("manifest.json", b"{}")
        with pytest.raises(FileExistsError):
            store.put_exclusive("manifest.json", b"{ }")
        assert store.read("manifest.json") == b"{}"
        assert store.list() == {"manifest.json": 2}  # no probe or temp file left behind

    @applies_when(writable=True, exclusive_create=True)
    def test_exclusive_create_capability_holds_under_a_race(self, store: Store) -> None:
        won: list[int] = []
        barrier = threading.Barrier(4)

        def race(i: int) -> None:
            barrier.wait()
            try:
                store.put_exclusive(".writer-lock", str(i).encode())
                won.append(i)
            except FileExistsError:
                pass

        threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1
        assert store.read(".writer-lock") == str(won[0]).encode()

    @applies_when(writable=True)
    def test_delete_removes_a_file_and_ignores_a_missing_one(self, store: Store) -> None:
        put(store, "a/b.bin", b"b")
        put(store, "a/c.bin", b"c")
        store.delete("a/b.bin")
        store.delete("a/b.bin")
        store.delete("never/was")
        assert store.list() == {"a/c.bin": 1}

    @applies_when(writable=True)
    def test_sync_and_empty_directory_removal(self, store: Store) -> None:
        put(store, "a/b/c.bin", b"c")
        put(store, "d.bin", b"d")
        store.sync_dirs(["a/b/c.bin", "d.bin"])
        store.delete("a/b/c.bin")
        store.remove_empty_dirs("a")
        assert store.list() == {"d.bin": 1}
        if store.capabilities.local:
            assert not os.path.exists(os.path.join(store.url, "a"))

    @applies_when(writable=True)
    def test_a_sibling_is_beside_the_root(self, store: Store) -> None:
        try:
            other = store.sibling("other")
        except UsageError:
            return  # a view that has no siblings
        put(other, "f", b"x")
        assert other.url.rstrip("/").endswith("/other")
        assert store.list() == {} and other.read("f") == b"x"

    # ------------------------------------------------------------ safety (paths: all; symlinks, special files: local)

    # every store: a key with '..' would escape the root through a client or proxy that normalizes it
    @pytest.mark.parametrize("path", UNSAFE)
    def test_a_path_that_is_not_plain_is_refused(self, store: Store, path: str) -> None:
        calls: list[Callable[[], object]] = [lambda: store.read(path), lambda: store.size(path)]
        if self.writable:
            calls += [lambda: store.create(path), lambda: store.put_exclusive(path, b"x")]
        for call in calls:
            # a listing view never reaches the filesystem with a path it did not list: missing, not unsafe
            with pytest.raises(MissingFileError if self.listing_view else UnsafePathError) as info:
                call()
            assert self.listing_view or getattr(info.value, "problem", None) == "name"

    # no symlinks or special files on an object store; a listing view's layers refuse them
    @applies_when(local=True, listing_view=False)
    def test_local_means_symlinks_and_special_files_are_refused_by_category(self, holding: Holding) -> None:
        store = holding({"real/f.bin": b"x"})
        root = Path(store.url)
        (root / "link.bin").symlink_to(root / "real" / "f.bin")
        (root / "dirlink").symlink_to(root / "real")
        os.mkfifo(root / "fifo")
        for path in ("link.bin", "dirlink/f.bin"):
            with pytest.raises(UnsafePathError) as linked:
                store.read(path)
            assert (linked.value.problem, linked.value.requirement, linked.value.code) == (
                "symlink",
                "PTH-3",
                "unsafe_path",
            )
        with pytest.raises(UnsafePathError) as fifo:
            store.read("fifo")
        assert (fifo.value.problem, fifo.value.requirement, fifo.value.code) == ("file_kind", "PTH-4", "unsafe_path")
        # a slot's marker (storage/slot.py) is a regular file that a plain LocalStore lists too
        kinds = {p: f.kind for p, f in LocalStore(root).list_detail().items() if p != IN_PLACE_MARKER}
        assert kinds == {"real/f.bin": None, "link.bin": "a symlink", "dirlink": "a symlink", "fifo": "a FIFO"}


# ---------------------------------------------------------------- the backends


class TestLocalStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        yield LocalStore(tmp_path / "ckpt")

    def test_a_huge_sparse_file_is_refused_before_it_is_read(self, tmp_path: Path) -> None:
        store = LocalStore(tmp_path)
        with open(tmp_path / "big.json", "wb") as f:
            f.write(b"{")
            f.truncate(4 << 30)
        with pytest.raises(SizeMismatchError, match=r"big\.json"):
            store.read("big.json")  # the default bound

    def test_a_read_kept_cached_or_not_and_a_range_dropped_after(self, tmp_path: Path) -> None:
        store, page = LocalStore(tmp_path), mmap.PAGESIZE
        (tmp_path / "f").write_bytes(os.urandom(64 * page))
        evict(tmp_path)
        views = [(0, memoryview(bytearray(32 * page))), (32 * page, memoryview(bytearray(32 * page)))]
        store.read_ranges("f", views[:1], keep_cached=False)
        assert not any(resident(tmp_path / "f")[:32])  # the range read; the kernel's readahead past it may stay
        store.read_ranges("f", views, keep_cached=True)
        assert all(resident(tmp_path / "f"))
        store.drop_cached("f", 16 * page, 48 * page)
        assert resident(tmp_path / "f") == [True] * 16 + [False] * 32 + [True] * 16
        store.drop_cached("f", 0, 64 * page)
        assert cached_pages(tmp_path / "f") == 0

    def test_back_to_back_ranges_are_merged_into_one_vectored_read(self) -> None:
        views = [memoryview(bytearray(n)) for n in (8, 16, 4, 4)]
        runs = merge_adjacent([(24, views[1]), (0, views[0]), (48, views[2]), (52, views[3]), (40, memoryview(b""))])
        assert [(b, [len(v) for v in vs]) for b, vs in runs] == [(0, [8]), (24, [16]), (48, [4, 4])]


class TestSlotStore(StoreContract):
    in_place = True  # data files are rewritten in place (storage/slot.py); put_exclusive still publishes by link

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        yield SlotStore(tmp_path / "slot")

    def test_a_rewritten_file_keeps_its_inode(self, store: Store) -> None:
        put(store, "f", DATA)
        before = os.stat(os.path.join(store.url, "f")).st_ino
        put(store, "f", b"short")
        assert os.stat(os.path.join(store.url, "f")).st_ino == before
        assert store.read("f") == b"short"


class TestMemoryStore(StoreContract):
    local = False
    exclusive_create = False  # memory:// has no atomic create-if-absent

    @pytest.fixture
    def store(self, memory_url: str) -> Iterator[Store]:
        yield open_store(memory_url)


class TestS3Store(StoreContract):
    local = False  # exclusive create: a conditional PUT (If-None-Match)

    @pytest.fixture
    def store(self, s3_url: str) -> Iterator[Store]:
        from ckptfmt.storage import S3Store

        store = open_store(s3_url)
        assert isinstance(store, S3Store)
        yield store


class TestOverlayStore(StoreContract):
    """Read-only; each path answered by the first of its layers that holds it."""

    writable = False
    listing_view = True
    exclusive_create = False

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        yield OverlayStore([("a", LocalStore(tmp_path / "a"))])

    @pytest.fixture
    def holding(self, tmp_path: Path) -> Holding:
        def make(files: Mapping[str, bytes]) -> Store:
            layers = [LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")]
            for i, (path, data) in enumerate(sorted(files.items())):
                put(layers[i % 2], path, data)  # the files spread over both layers
            return OverlayStore([("a", layers[0]), ("b", layers[1])])

        return make

    def test_the_first_layer_answers_and_is_recorded(self, tmp_path: Path) -> None:
        a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
        put(a, "f", b"from a")
        put(b, "f", b"from b")
        put(b, "g", b"only b")
        overlay = OverlayStore([("a", a), ("b", b)])
        assert overlay.read("f") == b"from a" and overlay.read("g") == b"only b"
        assert overlay.sources == {"f": "a", "g": "b"}


class TestRoutedStore(StoreContract):
    """A referencing checkpoint's view: read-only, ``../<name>/`` paths answered by the base's store."""

    writable = False

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        own = LocalStore(tmp_path / "run" / "ckpt")
        yield RoutedStore(own, lambda location: own.sibling(location.removeprefix("../")))

    @pytest.fixture
    def holding(self, tmp_path: Path) -> Holding:
        def make(files: Mapping[str, bytes]) -> Store:
            own = LocalStore(tmp_path / "run" / "ckpt")
            for path, data in files.items():
                put(own, path, data)
            return RoutedStore(own, lambda location: own.sibling(location.removeprefix("../")))

        return make

    def test_a_parent_path_is_read_from_the_base_and_named_as_the_referrer_knows_it(self, tmp_path: Path) -> None:
        put(LocalStore(tmp_path / "run" / "base"), "weights/f.bin", DATA)
        own = LocalStore(tmp_path / "run" / "ckpt")
        opened: list[str] = []

        def open_base(location: str) -> Store:
            opened.append(location)
            return own.sibling(location.removeprefix("../"))

        routed = RoutedStore(own, open_base)
        assert routed.capabilities.references and not own.capabilities.references
        assert routed.read("../base/weights/f.bin") == DATA
        assert routed.size("../base/weights/f.bin") == len(DATA)
        with pytest.raises(MissingFileError) as info:
            routed.read("../base/weights/absent.bin")
        assert info.value.path == "../base/weights/absent.bin"
        assert opened == ["../base"]  # opened (and checked) once
        assert routed.base("../base").read("weights/f.bin") == DATA


def test_only_a_store_that_routes_references_opens_a_base(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        LocalStore(tmp_path).base("../other")


def test_a_failed_write_is_a_storage_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("a file where the root should be")
    with pytest.raises(StorageError) as info:
        LocalStore(tmp_path / "ckpt").create("f")
    assert info.value.path == "f"


def test_a_file_removed_while_a_directory_is_listed_is_left_out_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer renames its temporary file into place between the directory's read and the entry's lstat (a
    race CI met: ``cannot list: ... '.latest.json.tmp-...'``): the listing is of a moment just after."""
    from ckptfmt.storage import local

    (tmp_path / "kept").write_bytes(b"1")
    (tmp_path / ".latest.json.tmp-1").write_bytes(b"2")
    real = os.scandir

    class Vanishing:
        def __init__(self, fd: int) -> None:
            self.it = real(fd)

        def __enter__(self) -> Vanishing:
            return self

        def __exit__(self, *exc: object) -> None:
            self.it.close()

        def __iter__(self) -> Any:
            for entry in self.it:
                if entry.name.startswith(".latest.json.tmp"):
                    os.unlink(tmp_path / entry.name)  # gone before its lstat
                yield entry

    monkeypatch.setattr(local.os, "scandir", Vanishing)
    assert sorted(local.walk_lstat(tmp_path)) == ["kept"]
