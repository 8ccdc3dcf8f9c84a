"""What answered requests leave to metrics and statistics, written down as plain records while
they come and applied in bulk when somebody reads: a request appends a tuple to a book (no lock,
no callback of the event loop), and a fold applies every waiting record at once.

    book = ledger.book(apply)  # apply(records): the metrics and statistics of many records
    book.add(record)           # per request: one append
    ledger.fold()              # before every read: /metrics (the registry folds first), statistics

Whoever reads the metrics or statistics sees every record added before the read began: the
registry's first collector folds (Metrics), and the statistics are read under `folded()`. A book
also folds once it holds `bound` records, so memory stays bounded where nobody reads.

Records are added on the event loop's thread; a fold may run on another (a scrape runs off the
loop), so books are deques (append and popleft are atomic) and folds run one at a time, under
the ledger's lock. A fold that fails is logged, and its records are lost, not the server.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

R = TypeVar("R")
BOUND = 1024  # records a book holds before it folds by itself: about a second of a lone client's


class Book(Generic[R]):
    """Records of one kind, and how to apply them."""

    def __init__(self, ledger: Ledger, apply: Callable[[list[R]], None], bound: int) -> None:
        self._ledger, self._apply, self._bound = ledger, apply, bound
        self._records: collections.deque[R] = collections.deque()

    def add(self, record: R) -> None:
        records = self._records
        records.append(record)
        if len(records) >= self._bound:
            self._ledger.fold()

    def __len__(self) -> int:
        return len(self._records)

    def _fold(self) -> None:
        """Apply what is waiting now (the ledger's lock held); records added meanwhile wait."""
        records = self._records
        taken = [records.popleft() for _ in range(len(records))]
        if not taken:
            return
        try:
            self._apply(taken)
        except Exception:  # bookkeeping must never fail a request, nor stop the other books
            log.exception("%d records could not be applied to the metrics and statistics", len(taken))


class Ledger:
    def __init__(self, bound: int = BOUND) -> None:
        if bound < 1:
            raise ValueError(f"a ledger's bound must be at least 1 record, got {bound}")
        self._bound = bound
        self._books: list[Book[object]] = []
        self._lock = threading.RLock()  # a fold that reads (a collector) may fold again: reentrant
        self._after: list[Callable[[], None]] = []  # what follows each fold (the gauges that follow the server)

    def book(self, apply: Callable[[list[R]], None]) -> Book[R]:
        book: Book[R] = Book(self, apply, self._bound)
        self._books.append(book)  # type: ignore[arg-type]
        return book

    def after_fold(self, update: Callable[[], None]) -> None:
        """Call `update` after every fold of the whole ledger."""
        self._after.append(update)

    def fold(self) -> None:
        """Apply every record added so far, book by book, in the order the books were opened; then
        what follows each fold."""
        with self._lock:
            for book in self._books:
                book._fold()
            for update in self._after:
                update()

    @contextlib.contextmanager
    def folded(self) -> Iterator[None]:
        """Fold, and hold off other folds while the caller reads what they write."""
        with self._lock:
            self.fold()
            yield

    def waiting(self) -> int:
        """Records not applied yet."""
        return sum(len(book) for book in self._books)
