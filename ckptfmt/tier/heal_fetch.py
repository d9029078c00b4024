"""Taking a peer's offer (:mod:`ckptfmt.tier.heal_server`): every byte checked before it is visible, as MEM-10 asks.

:func:`fetch` asks a peer for its checkpoint at one step and writes it into an empty private directory: the offer
(bounded JSON, its step must be the one asked for), then the transfer, checked by
:func:`ckptfmt.tier.wire.receive_files`: the manifest hashes to the announced id and parses; each file is one the
manifest lists, and its pieces and its digest match before it is published under its name. Only when every file the
manifest lists arrived is the manifest written, last: the directory is then a committed checkpoint, before that it
is not one.

Whatever goes wrong, a peer that is gone, times out, or sends anything that does not check out, raises one
:class:`~ckptfmt.errors.HealRefusedError` that names the sender, and what was written is removed.
"""

from __future__ import annotations

import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, HealRefusedError, MalformedMessageError
from ..jsonio import load_json
from ..manifest_parse import parse_manifest
from ..paths import MANIFEST_NAME
from ..storage.local import LocalStore
from .heal_server import OFFER_BYTES, TAG, TOKEN_HEADER
from .stream_channel import StreamChannel
from .wire import receive_bounded, receive_files

ERROR_TEXT_BYTES = 4096  # a refusing server's reason


@dataclass(frozen=True, slots=True, kw_only=True)
class Fetched:
    """A peer's checkpoint, committed in ``directory``: its id, what the offer said, the bytes moved, the time."""

    directory: str
    checkpoint_id: str
    info: dict[str, Any]
    nbytes: int
    seconds: float
    sender: str


def fetch(address: str, step: int, directory: str, *, timeout: float, token: str | None = None) -> Fetched:
    """Take ``address``'s offer of ``step`` into ``directory`` (empty, private: made by the caller); module doc."""
    started = time.perf_counter()
    url = f"{address}/heal/{int(step)}"
    try:
        return _fetch(url, address, step, directory, timeout, started, token)
    except HealRefusedError:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    except CheckpointError as exc:
        shutil.rmtree(directory, ignore_errors=True)
        raise HealRefusedError(
            f"the heal from {address} at step {step} was refused: {exc.message}", path=exc.path, tensor=exc.tensor
        ) from exc


def _fetch(
    url: str, address: str, step: int, directory: str, timeout: float, started: float, token: str | None
) -> Fetched:
    request = urllib.request.Request(url, headers={TOKEN_HEADER: token} if token is not None else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        reason = exc.read(ERROR_TEXT_BYTES).decode("utf-8", "replace")
        raise HealRefusedError(f"{address} did not send step {step}: HTTP {exc.code} {exc.reason} {reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise HealRefusedError(f"{address} could not be reached for step {step} (timed out or refused): {exc}") from exc
    with response:
        channel = StreamChannel(peer=address, read_into=response.readinto)
        try:
            info = load_json(
                receive_bounded(channel, 0, TAG, OFFER_BYTES, "an offer"),
                error=MalformedMessageError,
                what=f"the offer from {address}",
                allow_float=False,
            )
            if not isinstance(info, dict) or info.get("step") != step:
                raise MalformedMessageError(f"{address} offered {info!r:.200}, not step {step}")
            store = LocalStore(directory, direct_io=False)
            received = receive_files(channel, src=0, tag=TAG, destination=store)
        except TimeoutError as exc:
            raise HealRefusedError(f"the transfer from {address} timed out: {exc}") from exc
    listed = {f.path for f in parse_manifest(received.manifest_bytes).files}
    missing = listed - {f.path for f in received.files}
    if missing:
        raise HealRefusedError(
            f"{address} sent {len(received.files)} of the {len(listed)} files its manifest lists",
            path=sorted(missing)[0],
        )
    store.put_exclusive(MANIFEST_NAME, received.manifest_bytes)  # last: only now is the directory a checkpoint
    return Fetched(
        directory=directory,
        checkpoint_id=received.checkpoint_id,
        info=info,
        nbytes=received.nbytes,
        seconds=time.perf_counter() - started,
        sender=address,
    )
