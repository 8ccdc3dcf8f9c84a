"""Versions loaded and unloaded while the server serves.

A version loads beside the ones serving (on a thread of its own, so that batches go on), passes
the checks every load makes (manifest and integrity, each backend's self-check against the float64
reference), and only then takes new requests. The versions the policy no longer names retire: a
retiring version serves the sequences begun on it and unloads when the last one ends or idles out.
A version that fails a check is refused with the reason; it stands in for nothing, and the version
it would have replaced goes on serving. One load, poll or unload at a time."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from service.engine.sources import ModelSource, VersionPolicy
from service.engine.versions import Loaded, Versions, VersionState
from service.errors import LoadRefused

log = logging.getLogger(__name__)

Prepared = TypeVar("Prepared")  # a version read and self-checked, not yet serving
Signature = tuple[tuple[str, int, int], ...]  # a version directory's files: (name, size, mtime_ns)


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # version -> why

    def refusal(self, model: str, serving: list[str]) -> LoadRefused | None:
        """The load call's answer when a version was refused: each reason, and what serves on."""
        if not self.failed:
            return None
        reasons = "; ".join(f"version {v}: {why}" for v, why in self.failed.items())
        return LoadRefused(f"model {model!r} refused {reasons}. Serving on: versions {serving}")

    def tell(self, model: str, count: Callable[[int, int], None]) -> None:
        """The loads and refusals counted (`count(loaded, refused)`), and each refusal said in an
        ERROR line: the loader reports them, its callers tell them (a start that fails says why once)."""
        count(len(self.loaded), len(self.failed))
        for version, why in self.failed.items():
            if version == "*":
                log.error("model %s: its folder cannot be served as it is: %s", model, why)
            else:
                log.error("model %s version %s refused: %s", model, version, why)


def settle_heap() -> None:
    """Every object left from a load or unload collected, then what is alive kept out of later
    collections (`gc.freeze`): the modules and the versions serving live as long as the process,
    and a full collection would walk them all, holding the interpreter for every thread meanwhile.
    Unfrozen first, so that what an unloaded version leaves in cycles is freed."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def signature(directory: Path | None) -> Signature:
    """What a version directory holds now: a refused version is tried again once it changes."""
    if directory is None or not directory.is_dir():
        return ()
    files = sorted(p for p in directory.iterdir() if p.is_file())
    return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files)


class Keeping(Protocol[Prepared]):
    """What a version's life is made of, as the loader asks for it."""

    def prepare(self, version: str, directory: Path | None) -> Prepared:
        """A version read and self-checked (blocking: on the loader's thread)."""

    def start(self, prepared: Prepared) -> Loaded:
        """It serves (on the event loop)."""

    def stop(self, loaded: Loaded) -> None:
        """It closes, once it has stopped serving."""

    def changed(self) -> None:
        """The versions changed."""


@dataclass
class Refused:
    """What was refused, so that a refusal unchanged since is said (and counted) once, not at
    every poll."""

    versions: dict[str, Signature] = field(default_factory=dict)  # each version, as its files were then
    folder: str | None = None  # why the model's folder could not say what to serve, while it cannot


class VersionLoader(Generic[Prepared]):
    def __init__(self, source: ModelSource, versions: Versions, keeping: Keeping[Prepared]) -> None:
        self.source, self.versions, self._keeping = source, versions, keeping
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="load")
        self._lock = asyncio.Lock()
        self._refused = Refused()
        self._tasks: set[asyncio.Task[None]] = set()
        self.policy = VersionPolicy()  # as the repository last stated it

    async def sync(self, retry_refused: bool = True) -> LoadReport:
        """Serve what the source names now: load the new versions, retire the others."""
        async with self._lock:
            report = LoadReport()
            try:
                wanted, policy = self.source.wanted()
            except (OSError, ValueError) as exc:  # the versions serving go on
                return self._unusable(str(exc), report, retry_refused)
            self._refused.folder = None
            self.policy = policy
            for version, directory in wanted.items():
                await self._bring_in(version, directory, report, retry_refused)
            self._retire_unwanted(set(wanted), len(report.failed))
            if report.loaded:
                settle_heap()
            log.debug("model %s: serving %s (%s)", self.source.name, [v.version for v in self.versions], policy)
            self._keeping.changed()
            return report

    def _unusable(self, why: str, report: LoadReport, retry: bool) -> LoadReport:
        """The model's folder cannot say what to serve: refused, said (and counted) once while it
        stays so, unless asked again (a load call)."""
        if retry or why != self._refused.folder:
            report.failed["*"] = why
        self._refused.folder = why
        return report

    async def _bring_in(self, version: str, directory: Path | None, report: LoadReport, retry: bool) -> None:
        current = self.versions.get(version)
        if current is not None and current.state is not VersionState.UNLOADING:
            if current.state is VersionState.RETIRING:  # named again before its last sequence ended
                current.state = VersionState.SERVING
                log.info("model %s version %s serves again", self.source.name, version)
            return
        seen = signature(directory)
        if not retry and self._refused.versions.get(version) == seen:  # refused before, unchanged since: said once
            return
        try:
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(self._executor, self._keeping.prepare, version, directory)
        except Exception as exc:  # a version that cannot be served: refused, the others go on
            if self.source.folder is None:  # one model directory: nothing else to serve, the caller says why
                raise
            self._refused.versions[version] = seen
            report.failed[version] = str(exc)
            return
        self._refused.versions.pop(version, None)
        self.versions.add(self._keeping.start(prepared))
        report.loaded.append(version)
        log.info("model %s version %s loaded from %s", self.source.name, version, directory or "the default model")

    def _retire_unwanted(self, wanted: set[str], failed: int) -> None:
        """Serving versions the policy no longer names retire, but a version refused leaves the
        version it would have replaced serving in its place (the highest ones stay)."""
        unwanted = [v for v in self.versions.serving() if v.version not in wanted]
        for loaded in unwanted[: max(0, len(unwanted) - failed)]:
            self.retire(loaded)

    def retire(self, loaded: Loaded) -> None:
        loaded.state = VersionState.RETIRING
        if loaded.live_sequences:
            log.info(
                "model %s version %s retires: it serves its %d live sequences until they end, nothing new",
                self.source.name,
                loaded.version,
                loaded.live_sequences,
            )
        self.sequences_changed(loaded)

    def sequences_changed(self, loaded: Loaded) -> None:
        """A version's live sequences changed: a retiring version with none left unloads."""
        if loaded.state is VersionState.RETIRING and not loaded.live_sequences:
            self._spawn(self.unload(loaded))

    def _spawn(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def unload(self, loaded: Loaded) -> None:
        """Nothing new goes to `loaded`; what it queued finishes; then its memory is returned."""
        if loaded.state is VersionState.UNLOADING:
            return
        loaded.state = VersionState.UNLOADING
        self._keeping.changed()
        await self._stop_serving(loaded)
        self.versions.remove(loaded)
        self._keeping.stop(loaded)
        settle_heap()  # the sessions and caches go now, not at the next full collection
        log.info("model %s version %s unloaded", self.source.name, loaded.version)
        self._keeping.changed()

    @staticmethod
    async def _stop_serving(loaded: Loaded) -> None:
        await loaded.decoder.close()
        await loaded.batcher.stop()

    async def unload_all(self) -> list[str]:
        async with self._lock:
            gone = [loaded.version for loaded in self.versions]
            await asyncio.gather(*(self.unload(loaded) for loaded in list(self.versions)))
            return gone

    async def settled(self) -> None:
        """Return once the unloads under way (retired versions whose last sequence ended) are done."""
        while pending := [task for task in self._tasks if not task.done()]:
            await asyncio.wait(pending)

    async def close(self) -> None:
        await self.settled()
        self._executor.shutdown(wait=True)
