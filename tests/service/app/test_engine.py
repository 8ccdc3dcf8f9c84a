"""What follows an audit's verdict (service/app/engine.py's Verdicts): a mismatch quarantines its
backend on the compute thread, then, on the event loop, drops its sequences and tells the other
workers, for a backend on a device they all share (the CPU; a GPU, unless each worker has its own).
The incident's log line says since when the backend's answers may be wrong."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from service.app.engine import Verdicts
from service.engine.audit import Check, Sample
from service.engine.versions import Versions
from service.metrics import Metrics


def _sample(
    device: str, quarantine: list[str], request_id: str = "r-1", backend: str = "ort-cpu", times: int = 1
) -> Sample:
    """`times`: what its quarantine answers, the times its backend was found wrong (0: the same incident)."""
    x = np.zeros((1, 4, 8), np.float32)  # (1, T, C)

    def enter(name: str) -> int:
        quarantine.append(name)
        return times

    return Sample(x, x.copy(), 0, x.shape, backend, request_id, "3", device, "fp32", enter)


@pytest.mark.parametrize("times,new", [(2, True), (0, False)])
@pytest.mark.parametrize(
    "device,own_gpu,shared",
    [("cpu", False, True), ("cpu", True, True), ("cuda:0", False, True), ("cuda:0", True, False)],
)
@pytest.mark.parametrize("check,wrong", [(Check(0.5, 1e-5), True), (Check(1e-7, 1e-5), False)])
def test_a_mismatch_on_a_shared_device_is_told_to_the_other_workers_after_its_quarantine(
    device: str, own_gpu: bool, shared: bool, check: Check, wrong: bool, times: int, new: bool
) -> None:
    """The CPU, and the GPUs unless each worker has one of its own (`--workers auto` on a GPU host).
    With the times it was found wrong, for the others to count as many; not at all when it was
    the same incident (an earlier answer audited late), which they were told of already."""
    quarantined: list[str] = []
    told: list[tuple[str, str, str, int]] = []
    loop = asyncio.new_event_loop()
    with ThreadPoolExecutor(max_workers=1) as compute:
        metrics, versions = Metrics(CollectorRegistry()), Versions("mha")
        verdicts = Verdicts(metrics, versions, compute, loop, lambda *verdict: told.append(verdict), own_gpu)
        verdicts.checked(_sample(device, quarantined, times=times), check, 0.01)  # this thread: the audit's
        compute.submit(lambda: None).result()  # the quarantine ran, and scheduled what follows it
        assert told == []  # the others are told on the event loop, after the quarantine
        loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    assert quarantined == (["ort-cpu"] if wrong else [])
    assert told == ([("3", "ort-cpu", device, 2)] if wrong and shared and new else [])


def test_a_mismatch_says_since_when_the_backends_answers_may_be_wrong(caplog: pytest.LogCaptureFixture) -> None:
    """After the last audit of that backend (of that version) that passed: what went out before it
    was checked; a backend never checked before may have answered wrongly from its start."""
    now, quarantined, loop = [100.0], [], asyncio.new_event_loop()
    with ThreadPoolExecutor(max_workers=1) as compute:  # the quarantines run there, then schedule the drops
        metrics, versions = Metrics(CollectorRegistry()), Versions("mha")
        verdicts = Verdicts(metrics, versions, compute, loop, None, clock=lambda: now[0])
        wrong, right = Check(0.5, 1e-5), Check(1e-7, 1e-5)
        verdicts.checked(_sample("cpu", quarantined, "r-0"), wrong, 0.01)
        verdicts.checked(_sample("cpu", quarantined, "r-1"), right, 0.01)
        verdicts.checked(_sample("cpu", quarantined, "r-2", backend="torch-cpu"), right, 0.01)  # another's pass
        now[0] += 3.25
        verdicts.checked(_sample("cpu", quarantined, "r-3"), wrong, 0.01)
    loop.close()
    incidents = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(incidents) == 2 and "request 'r-0'" in incidents[0] and "request 'r-3'" in incidents[1]
    assert incidents[0].endswith("; no audit of ort-cpu passed before in this worker: any answer of it may be wrong")
    assert incidents[1].endswith(
        "; answers of ort-cpu since its last audit that passed, 3.2 s before (request 'r-1'), may be wrong too"
    )
