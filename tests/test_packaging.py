"""What the package declares matches what the code needs and what CI checks."""

from __future__ import annotations

import asyncio
import tomllib

from service.batching import MonotonicClock
from tests.support import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_python_311_is_required_and_checked_alike() -> None:
    """The batcher's waits rely on asyncio.TimeoutError being the builtin TimeoutError (3.11+);
    on 3.10 the batch loop died. pip must refuse 3.10, and ruff and mypy check the same version."""
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == "3.11"


def test_a_clock_wait_that_times_out_returns_quietly() -> None:
    async def main() -> bool:
        event = asyncio.Event()
        clock = MonotonicClock()
        await clock.wait(event, clock.now() + 0.001)
        return event.is_set()

    assert asyncio.run(main()) is False
