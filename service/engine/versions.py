"""The versions of the model loaded now, and which one a request goes to.

A version is SERVING (new requests and new sequences may go to it; the highest is the latest),
RETIRING (out of the policy, or replaced: it serves only the sequences begun on it, and unloads
once the last one ends or idles out) or UNLOADING (nothing new; what is queued finishes). A
sequence's steps always go to the version that holds its keys and values: they were computed
with that version's weights."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.engine.sources import version_number
from service.errors import InvalidInput, ModelNotFound, NotReady, quote

if TYPE_CHECKING:
    from service.backends.chain import BackendChain
    from service.backends.selection import Selection
    from service.decode.control import SequenceControl, SequenceId
    from service.decode.scheduler import Decoder
    from service.engine.audit import Reference
    from service.engine.door import Batcher
    from service.engine.served import ServedModel


class VersionState(enum.Enum):
    SERVING = "READY"  # Triton's words, as RepositoryIndex shows them
    RETIRING = "RETIRING"
    UNLOADING = "UNLOADING"


@dataclass(eq=False)
class Loaded:
    """One loaded version: its model, backends, batcher and live sequences."""

    model: ServedModel
    selection: Selection
    chain: BackendChain
    batcher: Batcher
    decoder: Decoder
    state: VersionState = field(default=VersionState.SERVING)
    reference: Reference | None = None  # the float64 reference its answers are audited against (None: no audit)

    @property
    def version(self) -> str:
        return self.model.version

    @property
    def live_sequences(self) -> int:
        return len(self.decoder.sequences)

    def holds(self, sequence_id: SequenceId) -> bool:
        return self.decoder.sequences.holds(sequence_id)


def _number(version: str) -> int:
    return version_number(version) or 0  # a name that is no version number ('v3', '²') sorts first


class Versions:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._by: dict[str, Loaded] = {}

    def __iter__(self) -> Iterator[Loaded]:
        return iter(list(self._by.values()))  # a copy: a version may unload while a caller walks them

    def __len__(self) -> int:
        return len(self._by)

    def get(self, version: str) -> Loaded | None:
        return self._by.get(version)

    def add(self, loaded: Loaded) -> None:
        """Kept lowest first, so that walking them (each request's routing) sorts nothing."""
        self._by[loaded.version] = loaded
        self._by = dict(sorted(self._by.items(), key=lambda item: _number(item[0])))

    def remove(self, loaded: Loaded) -> None:
        if self._by.get(loaded.version) is loaded:
            del self._by[loaded.version]

    def serving(self) -> list[Loaded]:
        """The versions new requests may go to, lowest first."""
        return [loaded for loaded in self if loaded.state is VersionState.SERVING]

    def holds(self, sequence_id: SequenceId) -> bool:
        """Does any version keep this sequence's keys and values in this process?"""
        return any(loaded.holds(sequence_id) for loaded in self)

    def latest(self) -> Loaded | None:
        serving = self.serving()
        return serving[-1] if serving else None

    def for_request(self, version: str) -> Loaded:
        """The version a new request (or a sequence's first step) goes to: the one it names, or
        the latest when it names none."""
        if not version:
            latest = self.latest()
            if latest is None:
                raise NotReady(f"no version of model {self.model_name!r} is loaded; retry once one is")
            return latest
        loaded = self._by.get(version)
        if loaded is not None and loaded.state is VersionState.SERVING:
            return loaded
        available = [v.version for v in self.serving()]
        named = f"version {quote(version)} of model {self.model_name!r}"
        what = f"unknown {named}"
        if loaded is not None and loaded.state is VersionState.RETIRING:
            what = f"{named} is retiring: it serves only the sequences begun on it"
        elif loaded is not None:
            what = f"{named} is unloading"
        raise ModelNotFound(f"{what}; available: {available} (or empty for latest)")

    def for_step(self, control: SequenceControl, version: str) -> Loaded:
        """The version a decode step goes to: a sequence's first step as a new request; every
        later one to the version that holds the sequence (the latest when none does: it answers
        that the sequence is not known)."""
        if control.start:
            return self.for_request(version)
        holder = next((v for v in self if v.state is not VersionState.UNLOADING and v.holds(control.id)), None)
        if holder is None:
            return self.for_request(version)
        if version and version != holder.version:
            raise InvalidInput(
                f"sequence {control.label()} began on version {holder.version!r} of model {self.model_name!r} and "
                f"goes on there (its keys and values were computed with that version's weights); this step names "
                f"version {quote(version)}: name {holder.version!r}, or none"
            )
        return holder
