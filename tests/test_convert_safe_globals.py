"""The numpy allow-list of RNG-file loads is scoped to that load (issue 23): another thread's
``torch.load(weights_only=True)`` meanwhile does not accept numpy globals, and the user's own
registrations (``add_safe_globals``) survive an import."""

from __future__ import annotations

import pickle
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptfmt.convert import convert, torch_pt
from ckptfmt.convert.torch_files import numpy_globals


def accelerate_state(root: Path) -> Path:
    import safetensors.torch

    root.mkdir()
    safetensors.torch.save_file({"w": torch.ones(2, 2)}, root / "model.safetensors")
    state = {
        "step": 0,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    torch.save(state, root / "random_states_0.pkl")
    return root


@pytest.fixture
def clean_allow_list() -> Iterator[None]:
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


def weights_only_load(path: Path) -> str:
    try:
        torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        return "refused"
    return "loaded"


def test_another_threads_load_does_not_get_the_numpy_allow_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_allow_list: None
) -> None:
    src = accelerate_state(tmp_path / "state")
    other = tmp_path / "other.pt"
    torch.save({"a": np.arange(3, dtype=np.uint32)}, other)  # needs numpy's globals to load
    assert weights_only_load(other) == "refused"
    seen: list[str] = []
    real = torch_pt._load

    def load_while_another_thread_loads(loc: Any) -> Any:
        value = real(loc)
        if loc.url.endswith(".pkl"):  # inside the RNG file's load: its allow-list is in force here
            thread = threading.Thread(target=lambda: seen.append(weights_only_load(other)))
            thread.start()
            thread.join()
        return value

    monkeypatch.setattr(torch_pt, "_load", load_while_another_thread_loads)
    convert(str(src), str(tmp_path / "out"), to="ckptfmt")
    assert seen == ["refused"]


def test_the_users_own_registrations_survive_an_rng_file_load(tmp_path: Path, clean_allow_list: None) -> None:
    src = accelerate_state(tmp_path / "state")
    mine = numpy_globals()
    torch.serialization.add_safe_globals(mine)
    convert(str(src), str(tmp_path / "out"), to="ckptfmt")
    assert set(mine) <= set(torch.serialization.get_safe_globals())
    other = tmp_path / "other.pt"
    torch.save({"a": np.arange(3, dtype=np.uint32)}, other)
    assert weights_only_load(other) == "loaded"


def test_the_allow_list_is_gone_after_the_load(tmp_path: Path, clean_allow_list: None) -> None:
    src = accelerate_state(tmp_path / "state")
    convert(str(src), str(tmp_path / "out"), to="ckptfmt")
    assert torch.serialization.get_safe_globals() == []
    other = tmp_path / "other.pt"
    torch.save({"a": np.arange(3, dtype=np.uint32)}, other)
    assert weights_only_load(other) == "refused"
