"""PyTorch .pt/.bin/.pth -> ckptfmt: a real nn.Module and AdamW state, weights_only loading, bit for bit."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

import ckptfmt

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import RUNNERS, assert_ckpt_tensor, run_cli


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model[2].to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    out = model[2](model[1](model[0](torch.randn(4, 8))).to(torch.bfloat16))
    out.float().pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("runner", RUNNERS)
def test_module_and_adamw(tmp_path: Path, runner: str) -> None:
    model, optimizer = trained()
    path = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, path)
    out = str(tmp_path / "ours")
    result = RUNNERS[runner]("convert", str(path), out, "--to", "ckptfmt", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["source"]["format"] == "pt"
    with ckptfmt.open(out) as ckpt:
        assert ckpt.profile == "weights"
        assert set(ckpt.fields) == {"weights", "optimizer", "provenance"}
        sd = model.state_dict()
        assert set(ckpt.tensor_names("weights")) == {f"model.{k}" for k in sd}
        for key, tensor in sd.items():
            assert_ckpt_tensor(ckpt, "weights", f"model.{key}", tensor)
        osd = optimizer.state_dict()
        expected = {f"state.{i}.{k}": v for i, s in osd["state"].items() for k, v in s.items()}
        assert set(ckpt.tensor_names("optimizer")) == set(expected)
        for name, tensor in expected.items():
            assert_ckpt_tensor(ckpt, "optimizer", name, tensor)
        groups = ckpt.read_context("optimizer")["param_groups"]
        assert groups[0]["lr"] == 1e-3 and groups[0]["weight_decay"] == 0.1
        assert groups[0]["betas"] == [0.9, 0.999] and groups[0]["params"] == osd["param_groups"][0]["params"]
        assert ckpt.read_context("weights") == {"epoch": 3}
        provenance = ckpt.read_context("provenance")
        assert provenance["converted_from"]["optimizer_keys"] == ["optimizer"]
    assert run_cli("verify", out).exit_code == 0


def test_bare_state_dict_bin_in_a_directory(tmp_path: Path) -> None:
    model, _ = trained()
    (tmp_path / "src").mkdir()
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    out = str(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "src"), out, "--to", "ckptfmt").exit_code == 0
    with ckptfmt.open(out) as ckpt:
        assert set(ckpt.fields) == {"weights", "provenance"}
        for key, tensor in model.state_dict().items():
            assert_ckpt_tensor(ckpt, "weights", key, tensor)


def test_optimizer_state_alone(tmp_path: Path) -> None:
    _, optimizer = trained()
    torch.save(optimizer.state_dict(), tmp_path / "opt.pth")
    out = str(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "opt.pth"), out, "--to", "ckptfmt").exit_code == 0
    with ckptfmt.open(out) as ckpt:
        assert ckpt.tensor_names("weights") == []
        assert "state.0.exp_avg" in ckpt.tensor_names("optimizer")


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_arbitrary_objects_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "x": Payload(str(marker))}, path)
    assert not marker.exists()
    result = run_cli("convert", str(path), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1
    assert result.json()["error"]["code"] == "invalid_source"
    assert not marker.exists()
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_legacy_pickle_file_is_refused_too(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(Payload(str(marker))))
    result = run_cli("convert", str(path), str(tmp_path / "out"), "--to", "ckptfmt")
    assert result.exit_code == 1 and "invalid_source" in result.stderr
    assert not marker.exists()


def test_pt_is_import_only(tmp_path: Path) -> None:
    result = run_cli("convert", str(tmp_path), str(tmp_path / "x.pt"), "--to", "pt")
    assert result.exit_code == 2 and "import only" in result.stderr


def test_missing_source_exit_2(tmp_path: Path) -> None:
    result = run_cli("convert", str(tmp_path / "none.pt"), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 2 and result.json()["error"]["code"] == "not_found"


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One training step on a batch that depends on ``seed`` alone."""
    optimizer.zero_grad()
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model[2](model[1](model[0](batch)).to(torch.bfloat16)).float().pow(2).mean().backward()
    optimizer.step()


def test_an_imported_optimizer_resumes_through_ckptfmt_torch(tmp_path: Path) -> None:
    """torch.save'd model + AdamW after a step -> ckpt convert -> ckptfmt.torch.load into fresh objects: the next
    step is bit-identical to continuing the original."""
    import ckptfmt.torch

    model, optimizer = trained()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "train.pt")
    out = str(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "train.pt"), out, "--to", "ckptfmt").exit_code == 0
    with ckptfmt.open(out) as ckpt:  # the layout ckptfmt.torch writes (a .pt file names no optimizer class)
        context = ckpt.read_context("optimizer")
        assert context["keys"] == "index" and "class" not in context and "state" not in context
        assert set(context) == {"keys", "param_groups", "scalars"}

    fresh, _ = trained(seed=1)
    again = torch.optim.AdamW(fresh.parameters(), lr=5.0)  # everything it needs comes from the checkpoint
    # the file keys the model's state under "model": restore into a module that holds it there
    ckptfmt.torch.load(out, model=torch.nn.ModuleDict({"model": fresh}), optimizer=again, restore_rng=False)
    _step(model, optimizer, seed=7)
    _step(fresh, again, seed=7)
    for (name, value), (_, other) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(value, other) and value.dtype == other.dtype, name
    continued, restored = optimizer.state_dict(), again.state_dict()
    assert restored["param_groups"] == continued["param_groups"]
    for pid, entries in continued["state"].items():
        for key, value in entries.items():
            assert torch.equal(restored["state"][pid][key], value), (pid, key)


def test_several_optimizers_are_stored_in_the_layout_and_export(tmp_path: Path) -> None:
    model, adamw = trained()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, sgd, seed=3)
    states = [adamw.state_dict(), sgd.state_dict()]
    torch.save({"model": model.state_dict(), "opt": {"a": states[0], "b": states[1]}}, tmp_path / "two.pt")
    out = str(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "two.pt"), out, "--to", "ckptfmt").exit_code == 0
    with ckptfmt.open(out) as ckpt:
        assert ckpt.read_context("provenance")["converted_from"]["optimizer_keys"] == ["opt.a", "opt.b"]
        assert "0/state.0.exp_avg" in ckpt.tensor_names("optimizer")
        assert "1/state.0.momentum_buffer" in ckpt.tensor_names("optimizer")
    assert run_cli("convert", out, str(tmp_path / "acc"), "--to", "accelerate").exit_code == 0
    for name, state in zip(("optimizer.bin", "optimizer_1.bin"), states, strict=True):
        _assert_same_state(torch.load(tmp_path / "acc" / name, weights_only=True), state)


def _assert_same_state(loaded: dict[str, object], state: dict[str, object], **scalars: object) -> None:
    assert loaded["param_groups"] == state["param_groups"]
    assert set(loaded["state"]) == set(state["state"])  # type: ignore[arg-type]
    for pid, entries in state["state"].items():  # type: ignore[attr-defined]
        got = loaded["state"][pid]  # type: ignore[index]
        assert set(got) == set(entries) | set(scalars if pid == 0 else {})
        for key, value in entries.items():
            assert torch.equal(got[key], value), (pid, key)
        for key, value in (scalars if pid == 0 else {}).items():
            assert got[key] == value


@pytest.mark.parametrize("several", [False, True])
def test_the_former_pt_import_layout_still_exports(tmp_path: Path, several: bool) -> None:
    """A checkpoint in the layout pt imports wrote before (context: the state dict less its tensors; several
    optimizers keyed by their path) exports to torch state dicts as before, non-tensor state included."""
    model, adamw = trained()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, sgd, seed=3)
    states = {"optimizer": adamw.state_dict()} | ({"extra.sgd": sgd.state_dict()} if several else {})

    def old(state: dict[str, object], prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        entries = state["state"].items()  # type: ignore[attr-defined]
        tensors = {f"{prefix}state.{pid}.{key}": value for pid, s in entries for key, value in s.items()}
        groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state["param_groups"]]  # type: ignore[attr-defined]
        return tensors, {"param_groups": groups, "state": {"0": {"note": 5}}}

    url = str(tmp_path / "old")
    with ckptfmt.open_writer(url, profile="weights") as writer:
        writer.write_tensors("weights", {f"model.{k}": v for k, v in model.state_dict().items()})
        writer.write_tensors("optimizer", {})
        if several:  # tensors <path>.state.0.exp_avg, context {<path>: {...}}
            contexts: dict[str, object] = {}
            for path, state in states.items():
                tensors, contexts[path] = old(state, f"{path}.")
                writer.write_tensors("optimizer", tensors)
            writer.write_context("optimizer", contexts)
        else:
            tensors, context = old(states["optimizer"], "")
            writer.write_tensors("optimizer", tensors)
            writer.write_context("optimizer", context)
        keys = {"optimizer_keys": list(states)}  # the order of several optimizers (the context's is sorted)
        writer.write_context("provenance", {"converted_from": {"format": "pt", "url": "train.pt", **keys}})
    assert run_cli("convert", url, str(tmp_path / "acc"), "--to", "accelerate").exit_code == 0
    for i, state in enumerate(states.values()):
        loaded = torch.load(tmp_path / "acc" / f"optimizer{f'_{i}' if i else ''}.bin", weights_only=True)
        _assert_same_state(loaded, state, note=5)


def test_lbfgs_history_lists_are_kept(tmp_path: Path) -> None:
    """LBFGS keeps tensors in lists (its history): stored as arrays in the state's scalars, restored as tensors."""
    import ckptfmt.torch

    def lbfgs(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 1)
        return model, torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=3)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(torch.randn(4, 3, generator=torch.Generator().manual_seed(0))).pow(2).mean()
            loss.backward()
            return loss

        optimizer.step(closure)  # type: ignore[arg-type]

    model, optimizer = lbfgs(0)
    step(model, optimizer)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "lbfgs.pt")
    out = str(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "lbfgs.pt"), out, "--to", "ckptfmt").exit_code == 0
    fresh, again = lbfgs(1)
    ckptfmt.torch.load(out, model=torch.nn.ModuleDict({"model": fresh}), optimizer=again, restore_rng=False)
    step(model, optimizer)
    step(fresh, again)
    assert torch.equal(model.weight, fresh.weight) and torch.equal(model.bias, fresh.bias)


def test_tensors_repeated_in_optimizer_lists_are_bounded(tmp_path: Path) -> None:
    big = torch.zeros(1 << 18)  # 1 MiB, referenced 100 times in one parameter's "history"
    torch.save({"o": {"state": {0: {"h": [big] * 100}}, "param_groups": [{"params": [0]}]}}, tmp_path / "amp.pt")
    result = run_cli("convert", str(tmp_path / "amp.pt"), str(tmp_path / "out"), "--to", "ckptfmt", "--json")
    assert result.exit_code == 1 and "amplification" in result.json()["error"]["message"]
