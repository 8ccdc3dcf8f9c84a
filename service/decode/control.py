"""What a request says about its sequence (Triton's sequence parameters): shared by the codec,
which reads it, and the core, which keeps the sequences. No torch, no gRPC."""

from __future__ import annotations

from dataclasses import dataclass

from service.errors import quote

SequenceId = int | str


@dataclass(frozen=True)
class SequenceControl:
    """A request's sequence parameters: which sequence, and whether this step starts or ends it."""

    id: SequenceId
    start: bool = False
    end: bool = False
    offset: int | None = None  # tokens the client believes the server holds before this step; None: unsaid

    def label(self) -> str:
        return quote(str(self.id), 48)
