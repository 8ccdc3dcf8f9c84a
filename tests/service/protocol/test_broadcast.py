"""What a worker tells the others without waiting for them (peers.Broadcast): an audit's verdict.
A worker that cannot be told is logged, and the teller goes on; the verdict is named for a worker
that starts later, with how many times that backend was found so. (A verdict that arrives is taken
as the receiver's own: tests/service/engine/test_audit.py, with two workers.)"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from service.protocol.peers import Broadcast, WorkerPeers


def test_a_worker_that_cannot_be_told_is_logged_and_the_teller_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def tell() -> None:
        Broadcast(WorkerPeers(0, 3, tmp_path)).distrust("1", "ort-cpu", "cpu", 2)  # workers 1 and 2 do not listen
        await asyncio.gather(*asyncio.all_tasks() - {asyncio.current_task()})  # what it told, told

    with caplog.at_level(logging.WARNING, logger="service.protocol.peers"):
        asyncio.run(tell())
    untold = sorted(r.getMessage() for r in caplog.records if "was not told" in r.getMessage())
    assert [message.split(":")[0] for message in untold] == [
        "worker 1 was not told of an audit's verdict",
        "worker 2 was not told of an audit's verdict",
    ]
    assert all("is not reachable" in message for message in untold), untold
    started_later = WorkerPeers(1, 3, tmp_path)  # the verdict is named for it, with its count and when
    (verdict,) = started_later.verdicts()
    assert (verdict.version, verdict.backend, verdict.device, verdict.by, verdict.times) == (
        "1",
        "ort-cpu",
        "cpu",
        "worker 0",
        2,
    )
    assert 0.0 <= verdict.ago_s < 60.0
