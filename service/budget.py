"""The bytes of requests and answers the server holds at once (queued, computing, waiting to be
written, on every call, stream and HTTP connection), and their limit: past it a new request is
refused at once instead of taking the process past its memory limit, where the OOM kill would
lose every live sequence on it.

    lease = budget.take(nbytes)   # raises Overloaded (retry) or TooLarge (never fits)
    ...                           # the request computed and its answer written
    lease.release()               # idempotent

Leases are taken and released on the event loop's thread; `held` may be read from any.
"""

from __future__ import annotations

from service.errors import Overloaded, TooLarge

MIB = 2**20


class Lease:
    """Bytes held by one request until it is released."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: InflightBudget, nbytes: int) -> None:
        self._budget: InflightBudget | None = budget
        self.nbytes = nbytes

    def grow(self, nbytes: int, what: str) -> None:
        """Hold `nbytes` more for the same request (a body read as it arrives): refused as `take`
        refuses, the request's whole size counted against the whole budget."""
        assert self._budget is not None, "a released lease does not grow"
        self._budget.check(self.nbytes + nbytes, nbytes, what)
        self._budget.hold(nbytes)
        self.nbytes += nbytes

    def release(self) -> None:
        if self._budget is not None:
            self._budget.held -= self.nbytes
            self._budget = None


class InflightBudget:
    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"an in-flight budget needs at least 1 byte, got {limit_bytes}")
        self.limit = limit_bytes
        self.held = 0
        self.peak = 0  # the most held at once since the last look (peak_since)

    def take(self, nbytes: int, what: str = "its input and its answer") -> Lease:
        """Hold `nbytes` for a request, or refuse it: RESOURCE_EXHAUSTED while the server holds
        too much (retry shortly), 413 / RESOURCE_EXHAUSTED when one request alone exceeds the
        whole budget (split it)."""
        self.check(nbytes, nbytes, what)
        self.hold(nbytes)
        return Lease(self, nbytes)

    def hold(self, nbytes: int) -> None:
        """`nbytes` more held (checked already), the peak kept."""
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def peak_since(self) -> int:
        """The most bytes held at once since the last call (the first: since the start)."""
        peak, self.peak = self.peak, self.held
        return peak

    def check(self, total: int, more: int, what: str) -> None:
        """May a request of `total` bytes hold `more` of them now? TooLarge if its total alone
        exceeds the whole budget; Overloaded if `more` does not fit beside what is held."""
        if total > self.limit:
            raise TooLarge(
                f"this request needs {total / MIB:.1f} MiB in flight ({what}), more than this "
                f"server's whole in-flight budget of {self.limit / MIB:.0f} MiB (--max-inflight-mb): split the batch"
            )
        if self.held + more > self.limit:
            raise Overloaded(
                f"the server holds {self.held / MIB:.0f} MiB of requests and answers in flight and this request needs "
                f"{more / MIB:.1f} MiB more; its limit is {self.limit / MIB:.0f} MiB (--max-inflight-mb): "
                "retry shortly, or on another replica"
            )
