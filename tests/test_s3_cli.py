"""The ``ckpt`` command on s3:// URLs, against moto's real S3 server (no patched client).

Every command through ``--storage-option`` (with the AWS environment variables removed, so nothing
else can point s3fs at the server), the AWS environment variables and a profile on their own, a
Hugging Face round trip through S3, and faults: a partition in the middle of a multi-file upload
(``ckpt ls`` shows the checkpoint incomplete, a retry commits), the server killed mid-conversion,
and a SIGKILLed writer whose orphaned multipart uploads gc aborts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from s3_server import CREDENTIALS, CountingProxy, MotoServer
from safetensors.torch import load_file

import ckptfmt
from ckptfmt.run import RunDirectory
from ckptfmt.storage import s3

sys.path.insert(0, str(Path(__file__).parent))
from cli_helpers import CKPT, RUNNERS, assert_same_tensor, run_cli, write_training

MiB = 1 << 20
AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS variable, and no ~/.aws: only what a test passes reaches s3fs."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


@pytest.fixture
def bucket(moto_server: MotoServer) -> str:
    return moto_server.create_bucket()


def options_for(endpoint: str, **extra: Any) -> dict[str, Any]:
    """Library storage options for the endpoint, and ``cli_args`` spells the same on the command line."""
    return {
        "endpoint_url": endpoint,
        "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"region_name": "us-east-1"},
        "skip_instance_cache": True,
        **extra,
    }


def cli_args(options: dict[str, Any]) -> list[str]:
    out = []
    for key, value in options.items():
        text = value if isinstance(value, str) else json.dumps(value)
        out += ["--storage-option", f"{key}={text}"]
    return out


def fast_fail(endpoint: str) -> dict[str, Any]:
    """One attempt per request, short timeouts: a test of an unreachable endpoint ends quickly."""
    return options_for(endpoint, config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2})


def state_dict(big_mib: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd = {
        "embed.weight": torch.randn(64, 16).to(torch.bfloat16),
        "layer0.weight": torch.randn(16, 16),
        "layer0.bias": torch.randn(16),
        "ids": torch.arange(5, dtype=torch.int64),
        "special": torch.tensor([float("nan"), -0.0, float("inf")]),
    }
    for i in range(4 if big_mib else 0):
        sd[f"big.{i}"] = torch.randn(big_mib * MiB // 4)
    return sd


def hf_dir(path: Path, sd: dict[str, torch.Tensor], max_shard_size: int | str) -> Path:
    path.mkdir()
    save_torch_state_dict(sd, path, max_shard_size=max_shard_size)
    return path


def load_hf(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return load_file(path / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(path / shard))
    return out


def keys_under(client: Any, bucket: str, prefix: str) -> list[str]:
    found = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in found)


def uploads_under(client: Any, bucket: str, prefix: str) -> list[str]:
    found = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return sorted(u["Key"] for u in found)


# ---------------------------------------------------------------- every command


@pytest.mark.parametrize("runner", RUNNERS)
def test_every_command_through_storage_options(
    moto_server: MotoServer, bucket: str, no_aws_env: None, runner: str
) -> None:
    ckpt = RUNNERS[runner]
    options = options_for(moto_server.endpoint)
    opts = cli_args(options)
    run = f"s3://{bucket}/run"
    first = write_training(f"{run}/step-100", step=100, storage_options=options)
    second = write_training(f"{run}/step-200", seed=1, step=200, storage_options=options)

    result = ckpt("inspect", f"{run}/step-100", "--tensors", "--json", *opts)
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["status"] == "committed" and doc["checkpoint_id"] == first and doc["step"] == 100
    assert {t["name"] for t in doc["tensors"]} >= {"layer0.w", "layer0.w.exp_avg"}

    result = ckpt("verify", f"{run}/step-200", "--json", *opts)
    assert result.exit_code == 0, result.stderr
    assert result.json()["ok"] and result.json()["checkpoint_id"] == second

    result = ckpt("ls", run, "--json", *opts)
    assert result.exit_code == 0, result.stderr
    listed = [(e["name"], e["status"], e["checkpoint_id"]) for e in result.json()["checkpoints"]]
    assert listed == [("step-200", "committed", second), ("step-100", "committed", first)]

    assert ckpt("diff", f"{run}/step-100", f"{run}/step-100", *opts).exit_code == 0
    result = ckpt("diff", f"{run}/step-100", f"{run}/step-200", "--ignore", "provenance", "--json", *opts)
    assert result.exit_code == 1, result.stderr
    changed = {t["name"] for t in result.json()["tensors"]["changed"]}
    assert "layer0.w" in changed

    # one flipped byte in a data file on S3: verify finds it
    client = moto_server.client()
    key = next(k for k in keys_under(client, bucket, "run/step-100/weights/") if k.endswith(".safetensors"))
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-1] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    result = ckpt("verify", f"{run}/step-100", "--json", *opts)
    assert result.exit_code == 1
    assert "digest_mismatch" in {p["code"] for p in result.json()["problems"]}


def test_endpoint_as_nested_client_kwargs(moto_server: MotoServer, bucket: str, no_aws_env: None) -> None:
    """s3fs also takes the endpoint inside client_kwargs, which --storage-option passes as JSON."""
    url = f"s3://{bucket}/ck"
    write_training(url, storage_options=options_for(moto_server.endpoint))
    options = options_for(moto_server.endpoint)
    del options["endpoint_url"]
    options["client_kwargs"] = {"endpoint_url": moto_server.endpoint, "region_name": "us-east-1"}
    result = run_cli("verify", url, *cli_args(options))
    assert result.exit_code == 0, result.stderr


def test_no_such_bucket_names_the_url(moto_server: MotoServer, no_aws_env: None) -> None:
    opts = cli_args(options_for(moto_server.endpoint))
    result = run_cli("inspect", "s3://no-such-bucket-here/ck", "--json", *opts)
    assert result.exit_code == 2
    assert "s3://no-such-bucket-here/ck" in result.stderr or "no-such-bucket-here" in result.stdout


@pytest.mark.parametrize("how", ["variables", "profile"])
def test_aws_environment_alone_is_enough(
    moto_server: MotoServer, bucket: str, no_aws_env: None, tmp_path: Path, how: str
) -> None:
    """A real ``ckpt`` process with no --storage-option: the usual AWS variables, or a profile, reach the server."""
    url = f"s3://{bucket}/run/step-100"
    ckpt_id = write_training(url, storage_options=options_for(moto_server.endpoint))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if how == "variables":
        env.update(CREDENTIALS, AWS_ENDPOINT_URL=moto_server.endpoint)
    else:
        config = tmp_path / "aws-config"
        config.write_text(f"[profile moto]\nregion = us-east-1\nendpoint_url = {moto_server.endpoint}\n")
        credentials = tmp_path / "aws-credentials"
        credentials.write_text(
            "[moto]\n"
            f"aws_access_key_id = {CREDENTIALS['AWS_ACCESS_KEY_ID']}\n"
            f"aws_secret_access_key = {CREDENTIALS['AWS_SECRET_ACCESS_KEY']}\n"
        )
        env.update(AWS_CONFIG_FILE=str(config), AWS_SHARED_CREDENTIALS_FILE=str(credentials), AWS_PROFILE="moto")
    for args in (["inspect", url, "--json"], ["verify", url, "--json"], ["ls", f"s3://{bucket}/run", "--json"]):
        proc = subprocess.run([str(CKPT), *args], capture_output=True, text=True, env=env, timeout=120, check=False)
        assert proc.returncode == 0, (args, proc.stderr)
        assert ckpt_id in proc.stdout


# ---------------------------------------------------------------- conversion


def test_hf_to_ckptfmt_on_s3_and_back_bit_for_bit(
    moto_server: MotoServer, bucket: str, no_aws_env: None, tmp_path: Path
) -> None:
    sd = state_dict()
    src = hf_dir(tmp_path / "hf", sd, max_shard_size=2000)
    assert (src / "model.safetensors.index.json").exists()
    opts = cli_args(options_for(moto_server.endpoint))
    url = f"s3://{bucket}/models/tiny"

    result = run_cli("convert", str(src), url, "--to", "ckptfmt", "--json", *opts)
    assert result.exit_code == 0, result.stderr
    assert result.json()["destination"] == {"url": url, "format": "ckptfmt"}
    assert run_cli("verify", url, *opts).exit_code == 0

    back = tmp_path / "back"
    result = run_cli("convert", url, str(back), "--to", "hf", "--max-shard-size", "2000", *opts)
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in src.iterdir())
    reloaded = load_hf(back)
    assert set(reloaded) == set(sd)
    for name, tensor in sd.items():
        assert_same_tensor(reloaded[name], tensor)


# ---------------------------------------------------------------- faults


WRITER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import ckptfmt
    from ckptfmt.storage import s3

    url, options, spec = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    s3.PART_SIZE = spec["part_size"]
    rng = np.random.default_rng(0)
    with ckptfmt.open_writer(url, storage_options=options, target_file_size=spec["file_size"]) as w:
        for i in range(spec["tensors"]):
            w.write_tensor("weights", f"layer{i}.w", rng.standard_normal(spec["floats"], dtype=np.float32))
        w.write_tensors("optimizer", {"step": np.array(3, np.int64)})
        w.write_context("rng", {"generators": {}})
        w.write_context("data", {"epoch": 0, "global_sample_offset": 96})
        w.write_config({"lr": 0.001})
        w.write_context("topology", {"world_size": 1})
        w.write_context("provenance", {"step": 7})
    print(w.checkpoint_id)
    """
)
# Twelve 1 MiB tensors, one file each, two uploading at a time.
SMALL_FILES = {"tensors": 12, "floats": MiB // 4, "file_size": MiB, "part_size": 5 * MiB}
# Eight 12 MiB tensors in 5 MiB parts: every data file is a multipart upload.
BIG_FILES = {"tensors": 8, "floats": 3 * MiB, "file_size": 12 * MiB, "part_size": 5 * MiB}


def writer(url: str, options: dict[str, Any], spec: dict[str, int]) -> subprocess.Popen[str]:
    """A training process writing a checkpoint to S3 (its own pid, so a lock it leaves is seen dead)."""
    args = [sys.executable, "-c", WRITER, url, json.dumps(options), json.dumps(spec)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_partition_mid_upload_is_incomplete_in_ls_then_retry_commits(
    moto_server: MotoServer, bucket: str, no_aws_env: None
) -> None:
    run = f"s3://{bucket}/run"
    url = f"{run}/step-7"
    direct = cli_args(options_for(moto_server.endpoint))
    with CountingProxy(moto_server.port).running() as proxy:
        proxy.cut_after = 5 * MiB  # some files are up, others in flight, the manifest never sent
        proc = writer(url, fast_fail(proxy.endpoint), SMALL_FILES)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1 and "StorageError" in stderr, stderr
        assert proxy.is_cut

    listed = run_cli("ls", run, "--json", *direct)
    assert listed.exit_code == 0, listed.stderr
    [entry] = listed.json()["checkpoints"]
    assert (entry["name"], entry["status"], entry["checkpoint_id"]) == ("step-7", "incomplete", None)
    assert entry["size"] > 0
    inspected = run_cli("inspect", url, "--json", *direct)
    assert inspected.exit_code == 1 and inspected.json()["status"] == "incomplete"
    assert run_cli("verify", url, *direct).exit_code == 1

    # the trainer restarts and saves again: the dead writer's lock is taken over, the checkpoint commits
    proc = writer(url, options_for(moto_server.endpoint), SMALL_FILES)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    listed = run_cli("ls", run, "--json", *direct)
    [entry] = listed.json()["checkpoints"]
    assert (entry["status"], entry["checkpoint_id"]) == ("committed", stdout.strip())
    assert run_cli("verify", url, *direct).exit_code == 0


def test_server_killed_mid_conversion_then_restarted(
    tmp_path: Path, no_aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moto keeps no state across a restart: the retry goes into a bucket created again."""
    monkeypatch.setattr(s3, "PART_SIZE", 5 * MiB)  # S3's smallest part: multipart uploads with little data
    sd = state_dict(big_mib=4)  # 16 MiB
    src = hf_dir(tmp_path / "hf", sd, max_shard_size="5MB")
    convert = ["convert", str(src), "--to", "ckptfmt", "--target-file-size", "6MiB"]
    server = MotoServer()
    server.start()
    try:
        bucket = server.create_bucket()
        url = f"s3://{bucket}/models/big"
        with CountingProxy(server.port).running() as proxy:
            opts = cli_args(fast_fail(proxy.endpoint))

            def kill_when_busy() -> None:
                while proxy.sent_to_server < 6 * MiB:
                    time.sleep(0.005)
                server.kill()

            killer = threading.Thread(target=kill_when_busy, daemon=True)
            killer.start()
            result = run_cli(*convert, url, "--json", *opts)
            killer.join(timeout=30)
            assert server.proc is None, "the server was not killed during the upload"
        assert result.exit_code == 2, result.stderr
        assert result.json()["error"]["code"] == "storage"

        server.start()
        bucket = server.create_bucket()
        url = f"s3://{bucket}/models/big"
        opts = cli_args(options_for(server.endpoint))
        result = run_cli(*convert, url, *opts)
        assert result.exit_code == 0, result.stderr
        assert run_cli("verify", url, *opts).exit_code == 0
        with ckptfmt.open(url, options_for(server.endpoint)) as ckpt:
            assert len({c.path for t in ckpt.fields["weights"].tensors.values() for c in t.chunks}) >= 3
    finally:
        server.kill()


@pytest.fixture
def killed_writer(moto_server: MotoServer, bucket: str, no_aws_env: None) -> Iterator[str]:
    """A real writer process SIGKILLed mid-upload; yields its run URL (the checkpoint is ``step-9``)."""
    run = f"s3://{bucket}/run"
    client = moto_server.client()
    with CountingProxy(moto_server.port).running() as proxy:
        # Upstream traffic stops after 16 MiB: the writer is then stuck retrying, its uploads open.
        proxy.cut_after = 16 * MiB
        options = options_for(proxy.endpoint, config_kwargs={"retries": {"max_attempts": 20}})
        proc = writer(f"{run}/step-9", options, BIG_FILES)
        try:
            for _ in range(3000):  # polls, not a clock: a hang guard of about a minute
                if proxy.is_cut and uploads_under(client, bucket, "run/"):
                    break
                assert proc.poll() is None, "the writer ended before it was killed"
                time.sleep(0.02)
            else:
                pytest.fail("the writer never got a multipart upload going")
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    yield run


def test_sigkilled_writer_leaves_uploads_that_run_gc_aborts(
    moto_server: MotoServer, bucket: str, killed_writer: str
) -> None:
    client = moto_server.client()
    assert uploads_under(client, bucket, "run/step-9/weights/")  # parts left behind by the killed process
    opts = cli_args(options_for(moto_server.endpoint))
    [entry] = run_cli("ls", killed_writer, "--json", *opts).json()["checkpoints"]
    assert entry["status"] == "incomplete"

    run = RunDirectory(killed_writer, options_for(moto_server.endpoint))
    doomed = run.gc(keep_last=None)
    assert [e.name for e in doomed] == ["step-9"]
    assert uploads_under(client, bucket, "run/") == []
    assert keys_under(client, bucket, "run/") == []


@pytest.mark.skipif("gc" not in run_cli("--help").stdout.split(), reason="`ckpt gc` is not there yet")
def test_sigkilled_writer_leaves_uploads_that_ckpt_gc_aborts(
    moto_server: MotoServer, bucket: str, killed_writer: str
) -> None:
    client = moto_server.client()
    assert uploads_under(client, bucket, "run/step-9/weights/")
    result = run_cli("gc", killed_writer, *cli_args(options_for(moto_server.endpoint)))
    assert result.exit_code == 0, result.stderr
    assert uploads_under(client, bucket, "run/") == []
    assert keys_under(client, bucket, "run/") == []
