"""``ckpt`` and ``import ckptfmt`` start without loading what they do not use (issue 44, "ckpt starts fast"): checked
by what a fresh interpreter has imported, never by elapsed time."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import click
from ckptfmt.cli.app import COMMANDS, cli

import ckptfmt


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter has imported once ``code`` ran."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    # cwd "/": ``-c`` puts the cwd first on sys.path, and a checkout's ckptfmt/ would shadow the installed package
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd="/").stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_the_help_table_says_what_each_command_says_of_itself() -> None:
    ctx = click.Context(cli)
    for name, (_, _, summary) in COMMANDS.items():
        command = cli.get_command(ctx, name)
        assert command is not None
        own = " ".join(inspect.cleandoc(command.help or "").split("\n\n")[0].split())
        assert summary == own, name


def test_ckpt_help_imports_no_command_and_not_numpy() -> None:
    loaded = _modules_after("from ckptfmt.cli import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass")
    commands = {f"ckptfmt.cli.{module}" for module, _, _ in COMMANDS.values()}
    assert not loaded & commands
    assert "numpy" not in loaded and "ckptfmt.reader" not in loaded


def test_import_ckptfmt_loads_only_its_errors_and_every_public_name_resolves() -> None:
    loaded = _modules_after("import ckptfmt")
    assert {m for m in loaded if m.startswith("ckptfmt.")} == {"ckptfmt._version", "ckptfmt.errors"}
    assert "numpy" not in loaded
    for name in ckptfmt.__all__:
        assert getattr(ckptfmt, name) is not None, name
    # what was importable before the package was lazy still is: names outside __all__, and submodules
    loaded = _modules_after("import ckptfmt\nckptfmt.open_checkpoint, ckptfmt.RawDigests\nckptfmt.tier.find_slots")
    assert {"ckptfmt.reader", "ckptfmt.incremental", "ckptfmt.tier"} <= loaded


def test_the_function_verify_is_not_shadowed_by_the_module_of_that_name() -> None:
    loaded = _modules_after("import ckptfmt.verify\nimport ckptfmt\nassert callable(ckptfmt.verify), ckptfmt.verify")
    assert "ckptfmt.verify" in loaded
    assert callable(ckptfmt.verify) and ckptfmt.verify.__module__ == "ckptfmt.entry"


def test_ckpt_verify_of_a_weights_checkpoint_never_imports_numpy(tmp_path: Path) -> None:
    """numpy (with ml_dtypes) was more than a third of ``ckpt verify``'s start: a verify holds no array, so the
    modules it runs import numpy only on first use (``ckptfmt.lazy_import``)."""
    import numpy as np

    url = str(tmp_path / "ckpt")
    with ckptfmt.open_writer(url, "weights") as writer:
        writer.write_tensor("weights", "w", np.arange(3 << 20, dtype=np.float32).reshape(3, 1 << 20))  # 12 MiB
        writer.write_tensor("weights", "b", np.ones(7, dtype=np.float16))
    loaded = _modules_after(
        f"from ckptfmt.cli import cli\ntry:\n    cli.main(['verify', {url!r}])\nexcept SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code"
    )
    assert "ckptfmt.verify" in loaded and "ckptfmt.reader" in loaded
    assert "numpy" not in loaded and "ml_dtypes" not in loaded and "zstandard" not in loaded
