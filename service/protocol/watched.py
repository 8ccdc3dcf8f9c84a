"""Files the server reads at start and again whenever one changes while it serves: a Kubernetes
Secret updated in place (a token added, a certificate renewed) is taken without a restart."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from service.batching import Clock

log = logging.getLogger(__name__)

FILES_READ_S = 10.0  # how often a worker looks at its watched files for a change


class WatchedFiles:
    """Subclasses say what the files are (`what`) and take them (`take`, raising ValueError
    with the reason for what it cannot take). A change that cannot be taken leaves what was
    taken before in place, with a warning."""

    what = "the files"
    label = "files"  # the metrics' name for them: a fixed word

    def __init__(self, *paths: Path | None) -> None:
        self._paths = paths
        self._seen = self._stamps()
        self.refused = False  # the last change seen could not be taken: the ones before are served

    def refused_now(self) -> float:
        """1 while the last change of the files is refused, else 0: a gauge's value."""
        return 1.0 if self.refused else 0.0

    def take(self) -> None:
        raise NotImplementedError

    def reread(self) -> bool:
        """The files taken again if one changed since last seen; whether they were."""
        if (stamps := self._stamps()) == self._seen:
            return False
        self._seen = stamps
        named = ", ".join(str(path) for path in self._paths if path is not None)
        try:
            self.take()
        except ValueError as exc:
            log.warning("%s (%s) changed but were not taken; the ones before stay: %s", self.what, named, exc)
            self.refused = True
            return False
        log.info("%s (%s) changed: the new ones are taken", self.what, named)
        self.refused = False
        return True

    async def follow(self, clock: Clock, stop: asyncio.Event, period_s: float = FILES_READ_S) -> None:
        while not stop.is_set():
            await clock.wait(stop, clock.now() + period_s)
            if not stop.is_set():
                self.reread()

    def _stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        return tuple(None if path is None else _stamp(path) for path in self._paths)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is written or replaced (a Secret's files are swapped in, not edited)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
