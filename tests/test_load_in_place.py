"""Loads into the live tensors' own memory (ckptfmt/torch/in_place.py) and the reads under them
(``Checkpoint.check_regions``, ``read_regions(into=...)``): checked first, copied in last, all or nothing."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ckptfmt
from ckptfmt.errors import DigestMismatchError, ResumeMismatchError, UsageError
from ckptfmt.read_plan import Target, whole
from ckptfmt.run import checkpoint_name
from ckptfmt.torch import CheckpointManager, ResumableSampler, api, read_state
from tests.page_cache import cached_pages, data_files, evict, pages


def _trained(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    return model, opt


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"w/{k}": v for k, v in model.state_dict().items()}
    for i, entry in opt.state_dict()["state"].items():
        out.update({f"o/{i}/{k}": v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out


def _addresses(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in _tensors(model, opt).items() if k != "o/0/step" and "step" not in k}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    model, opt = _trained(0, 3)
    url = tmp_path / "c"
    api.save(url, step=3, model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), config={})
    return url, copy.deepcopy(_tensors(model, opt))


def _flip(url: Path, field: str, back: int) -> None:
    """Flip one byte ``back`` bytes before the end of the field's data file (inside its last tensor)."""
    path = next((url / field).glob("*.safetensors"))
    with open(path, "r+b") as f:
        f.seek(-back, 2)
        byte = f.read(1)
        f.seek(-back, 2)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_live_load_fills_the_model_and_optimizer_in_their_own_memory(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    url, expected = saved
    model, opt = _trained(7, 2)  # another state, in memory the load must reuse
    before = _addresses(model, opt)
    api.load(url, model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), config={})
    assert _same(_tensors(model, opt), expected)
    assert _addresses(model, opt) == before  # every parameter and moment filled where it lives


def test_a_graph_that_saved_a_parameter_refuses_backward_after_the_load_as_after_copy(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Bytes written through numpy behind autograd's back: the load still counts as an in-place write to each
    parameter (``load_state_dict`` copies each into itself, which bumps its version), as a copy from memory did."""
    url, _ = saved
    model, opt = _trained(7, 2)
    loss = model(torch.randn(8, 16)).square().mean()  # the graph saved the weights
    api.load(url, model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), config={})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_flipped_byte_is_refused_before_any_live_tensor_changes(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    url, _ = saved
    for field in ("weights", "optimizer"):
        _flip(url, field, 3)
        model, opt = _trained(7, 2)
        before = copy.deepcopy(_tensors(model, opt))
        with pytest.raises(DigestMismatchError) as info:
            api.load(url, model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), config={})
        assert info.value.field == field and info.value.tensor is not None
        assert _same(_tensors(model, opt), before)
        _flip(url, field, 3)  # back as it was: the next field's turn


def test_bytes_changed_between_the_check_and_the_copy_are_caught_and_said(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    url, _ = saved
    model, opt = _trained(7, 2)
    with ckptfmt.open(url) as ckpt:
        live = api.live_targets(model, opt)
        snap = read_state.read_snapshot(ckpt, None, live)
        assert snap.copy_in is not None
        _flip(url, "weights", 3)  # something rewrote the committed file in place, after the check
        with pytest.raises(DigestMismatchError) as info:
            snap.copy_in()
    assert info.value.field == "weights"
    assert any("files changed during the load" in note for note in info.value.__notes__)


def test_from_an_object_store_the_load_reads_once_into_new_memory(tmp_path: Path) -> None:
    """No page cache to take the second pass from (memory:// as an object store would be): read once, as before."""
    model, opt = _trained(0, 3)
    url = f"memory://in-place-{tmp_path.name}/c"
    api.save(url, step=3, model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), config={})
    expected = copy.deepcopy(_tensors(model, opt))
    model, opt = _trained(7, 2)
    with ckptfmt.open(url) as ckpt:
        snap = read_state.read_snapshot(ckpt, None, api.live_targets(model, opt))
        assert snap.copy_in is None and ckpt.bytes_read == sum(
            c.nbytes for f in ckpt.fields.values() for t in f.tensors.values() for c in t.chunks
        )
    api.load(url, model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), config={})
    assert _same(_tensors(model, opt), expected)


def test_an_optimizer_left_out_is_not_filled(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    url, expected = saved
    model, opt = _trained(7, 2)
    moments = copy.deepcopy(opt.state_dict()["state"])
    api.load(url, model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), config={},
             skip_fields=("optimizer",))  # fmt: skip
    assert _same({k: v for k, v in _tensors(model, opt).items() if k.startswith("w/")},
                 {k: v for k, v in expected.items() if k.startswith("w/")})  # fmt: skip
    for i, entry in opt.state_dict()["state"].items():
        assert torch.equal(entry["exp_avg"], moments[i]["exp_avg"])


# ---------------------------------------------------------------- the library calls under it


@pytest.fixture
def blocked(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """One 4 MiB tensor in 64 KiB blocks (a partial read is checked block by block)."""
    data = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    url = tmp_path / "b"
    with ckptfmt.open_writer(url, profile="weights", block_bytes=64 << 10) as w:
        w.write_tensor("weights", "big", data)
    return url, data


def test_read_regions_into_fills_the_callers_arrays(blocked: tuple[Path, np.ndarray]) -> None:
    url, data = blocked
    with ckptfmt.open(url) as ckpt:
        record = ckpt.tensor("weights", "big")
        rows = Target("weights", "big", record.dtype, (100, 0), (50, 1024))
        dest_whole, dest_rows = np.empty((1024, 1024), np.float32), np.empty((50, 1024), np.uint32)  # bit patterns
        out = ckpt.read_regions([whole("weights", "big", record), rows], into=[dest_whole, dest_rows])
    assert out[0] is dest_whole and out[1] is dest_rows
    assert np.array_equal(dest_whole, data) and np.array_equal(dest_rows.view(np.float32), data[100:150])


@pytest.mark.parametrize(
    "dest, why",
    [
        (np.empty((1024, 1023), np.float32), "shape"),
        (np.empty((1024, 1024), np.int64), "dtype"),
        (np.empty((1024, 2048), np.float32)[:, ::2], "C-contiguous"),
    ],
)
def test_a_destination_that_does_not_fit_is_refused(
    blocked: tuple[Path, np.ndarray], dest: np.ndarray, why: str
) -> None:
    url, _ = blocked
    with ckptfmt.open(url) as ckpt, pytest.raises(UsageError) as info:
        ckpt.read_regions([whole("weights", "big", ckpt.tensor("weights", "big"))], into=[dest])
    assert info.value.tensor == "big", why


def test_check_regions_reads_only_the_blocks_a_region_touches_and_catches_a_flip_in_them(
    blocked: tuple[Path, np.ndarray],
) -> None:
    url, _ = blocked
    rows = Target("weights", "big", "F32", (100, 0), (50, 1024))  # 200 KiB: blocks 6..9
    with ckptfmt.open(url) as ckpt:
        ckpt.check_regions([rows])
        assert ckpt.bytes_read == 4 * (64 << 10)
    _flip(url, "weights", 3)  # in the last block: not read by this check
    with ckptfmt.open(url) as ckpt:
        ckpt.check_regions([rows])
        with pytest.raises(DigestMismatchError, match="block 63"):
            ckpt.check_regions([Target("weights", "big", "F32", (1000, 0), (24, 1024))])


class Tied(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight


@pytest.mark.parametrize("tied_now", [True, False])
def test_a_tied_tensor_fills_each_of_its_names_in_place(tmp_path: Path, tied_now: bool) -> None:
    """Saved tied (stored once, ``head.weight`` an alias); loaded into a model where it is tied too (one tensor)
    or not (two tensors, both filled, neither moved)."""
    torch.manual_seed(0)
    saved = Tied(tie=True)
    opt = torch.optim.SGD(saved.parameters(), lr=0.1)
    api.save(tmp_path / "c", step=1, model=saved, optimizer=opt, sampler=ResumableSampler(4, seed=0), config={})
    torch.manual_seed(9)
    model = Tied(tie=tied_now)
    before = (model.embed.weight.data_ptr(), model.head.weight.data_ptr())
    api.load(tmp_path / "c", model=model, restore_rng=False)
    assert torch.equal(model.embed.weight, saved.embed.weight) and torch.equal(model.head.weight, saved.embed.weight)
    assert (model.embed.weight.data_ptr(), model.head.weight.data_ptr()) == before
    assert (model.head.weight is model.embed.weight) == tied_now


def test_a_check_streams_across_the_small_tensors_between_and_checks_only_its_own(tmp_path: Path) -> None:
    """``a``, ``m``, ``z`` back to back in one file: checking ``a`` and ``z`` reads across ``m`` (one stream) but
    does not judge it, so a flip there passes this check and the read of ``m`` catches it."""
    url = tmp_path / "g"
    big = np.arange(1 << 16, dtype=np.float32)
    with ckptfmt.open_writer(url, profile="weights") as w:
        w.write_tensors("weights", {"a": big, "m": np.array([7], dtype=np.int64), "z": big + 1})
    with ckptfmt.open(url) as ckpt:
        records = {n: ckpt.tensor("weights", n) for n in ("a", "m", "z")}
        assert sorted(records, key=lambda n: records[n].chunks[0].begin) == ["a", "m", "z"]
        assert len({r.chunks[0].path for r in records.values()}) == 1
        ckpt.check_regions([whole("weights", n, records[n]) for n in ("a", "z")])
        assert ckpt.bytes_read == records["z"].chunks[0].end - records["a"].chunks[0].begin  # across m: one stream
    path = next((url / "weights").glob("*.safetensors"))
    with open(path, "r+b") as f:
        f.seek(records["m"].chunks[0].begin)
        f.write(b"\x08")
    with ckptfmt.open(url) as ckpt:
        ckpt.check_regions([whole("weights", n, records[n]) for n in ("a", "z")])
        with pytest.raises(DigestMismatchError):
            ckpt.read_tensor("weights", "m")


def test_the_managers_restore_fills_in_place_and_falls_back_past_a_flipped_byte(tmp_path: Path) -> None:
    """``restore_latest`` keeps the checkpoint open until it is applied: the newest, damaged, is passed over
    with nothing of it copied in; the one before fills the live tensors where they are."""
    model, opt = _trained(0, 2)
    sampler = ResumableSampler(32, seed=0)
    with CheckpointManager(tmp_path / "run", keep_last=None) as mgr:
        mgr.save(2, model=model, optimizer=opt, sampler=sampler, config={})
        expected = copy.deepcopy(_tensors(model, opt))
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
        mgr.save(4, model=model, optimizer=opt, sampler=sampler, config={})
    _flip(tmp_path / "run" / checkpoint_name(4), "optimizer", 3)
    model, opt = _trained(7, 2)
    before = _addresses(model, opt)
    mgr = CheckpointManager(tmp_path / "run")
    assert mgr.restore_latest(model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0)) == 2
    assert _same(_tensors(model, opt), expected)
    assert _addresses(model, opt) == before
    assert mgr.last_restore is not None and mgr.last_restore.skipped


# ---------------------------------------------------------------- what a load leaves in the page cache


def _big(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """1.5 MiB of weights and 3 MiB of AdamW moments: hundreds of pages per data file."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return model, opt


def _cached_share(url: Path) -> float:
    files = data_files(url)
    assert sum(pages(f) for f in files) > 1000
    return sum(cached_pages(f) for f in files) / sum(pages(f) for f in files)


def test_a_checkpoint_read_once_leaves_the_page_cache_whether_the_load_is_applied_or_refused(tmp_path: Path) -> None:
    """The check keeps its pages cached for the copy-in; a load applied drops them with the copy-in, and a load
    refused after the check (a strict mismatch, a flipped byte, a snapshot never applied) drops them too."""
    model, opt = _big(0)
    url = tmp_path / "c"
    api.save(url, step=1, model=model, optimizer=opt, sampler=ResumableSampler(32, seed=0), config={"lr": 1})
    target, target_opt = _big(1)
    loads = {"model": target, "optimizer": target_opt, "sampler": ResumableSampler(32, seed=0)}

    evict(url)
    with ckptfmt.open(url) as ckpt:
        snap = read_state.read_snapshot(ckpt, None, api.live_targets(target, target_opt))
        assert snap.copy_in is not None and _cached_share(url) == 1.0  # checked: kept for the copy-in
        snap.discard()  # never applied
        assert _cached_share(url) < 0.02  # the pages at the edges of a range stay: a few of over a thousand

    evict(url)
    api.load(url, config={"lr": 1}, **loads)
    assert _cached_share(url) < 0.02

    evict(url)
    with pytest.raises(ResumeMismatchError):
        api.load(url, config={"lr": 2}, on_mismatch="strict", **loads)
    assert _cached_share(url) < 0.02

    evict(url)
    _flip(url, "optimizer", 3)
    with pytest.raises(DigestMismatchError):
        api.load(url, config={"lr": 1}, **loads)
    assert _cached_share(url) < 0.02
