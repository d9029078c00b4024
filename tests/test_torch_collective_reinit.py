"""A process that destroys torch.distributed and initializes it again (an in-process restart) gets live groups.

ckptfmt keeps its dedicated gloo groups (a timeout of their own, one per background purpose) between calls.
Destroying the default group destroys them too; the cache used to hand the destroyed group out again, keyed by
``id(None)``, and the next exchange failed with "not initialized in the world group map".
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ckptfmt.torch.collective import TorchCollective


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[Path]:
    assert not dist.is_initialized()
    try:
        yield tmp_path
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_dedicated_group_is_made_again_after_the_world_is_destroyed_and_initialized_again(one_rank: Path) -> None:
    groups = []
    for attempt in range(2):
        store = dist.FileStore(str(one_rank / f"store-{attempt}"), 1)
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)
        collective = TorchCollective(timeout=timedelta(seconds=30), purpose="replica")
        assert collective.broadcast(b"step 7", src=0) == b"step 7"
        assert collective.gather(b"mine", dst=0) == [b"mine"]
        again = TorchCollective(timeout=timedelta(seconds=30), purpose="replica")
        assert again._group is collective._group  # one group per purpose while the world lives
        groups.append(collective._group)
        dist.destroy_process_group()
    assert groups[0] is not groups[1]
