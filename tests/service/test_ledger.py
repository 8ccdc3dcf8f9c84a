"""The ledger: records applied in bulk, before every read, with nothing lost or counted twice;
and bulk observation into prometheus-client's histograms exactly as observe() one by one."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from service.batching import BatchEvent
from service.ledger import Ledger
from service.metrics import Metrics


def test_records_wait_until_a_fold_then_apply_in_order_book_by_book() -> None:
    ledger = Ledger()
    applied: list[tuple[str, list[int]]] = []
    first = ledger.book(lambda records: applied.append(("first", records)))
    second = ledger.book(lambda records: applied.append(("second", records)))
    for i in range(3):
        second.add(i)
        first.add(10 + i)
    assert applied == [] and ledger.waiting() == 6
    ledger.fold()
    assert applied == [("first", [10, 11, 12]), ("second", [0, 1, 2])]
    ledger.fold()  # nothing new: nothing applied again
    assert len(applied) == 2 and ledger.waiting() == 0


def test_a_book_folds_by_itself_at_its_bound() -> None:
    ledger = Ledger(bound=4)
    applied: list[list[int]] = []
    book = ledger.book(applied.append)
    for i in range(9):
        book.add(i)
    assert applied == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(book) == 1


def test_a_fold_that_fails_is_logged_and_the_other_books_still_fold(caplog: pytest.LogCaptureFixture) -> None:
    ledger = Ledger()
    applied: list[list[str]] = []

    def broken(records: list[str]) -> None:
        raise ValueError("a metric that cannot be observed")

    ledger.book(broken).add("lost")
    ledger.book(applied.append).add("kept")
    with caplog.at_level("ERROR", logger="service.ledger"):
        ledger.fold()
    assert applied == [["kept"]]
    assert "1 records could not be applied" in caplog.text and "a metric that cannot be observed" in caplog.text


def test_folds_on_another_thread_lose_and_repeat_nothing() -> None:
    """A scrape folds off the event loop while requests keep adding: every record is applied once."""
    ledger = Ledger(bound=10_000_000)
    applied: list[int] = []
    book = ledger.book(applied.extend)
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            ledger.fold()

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for i in range(200_000):
            book.add(i)
    finally:
        done.set()
        scraper.join()
    ledger.fold()
    assert applied == list(range(200_000))


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 record"):
        Ledger(bound=0)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")  # when each was made, not what it counts
    }


def test_every_read_of_the_registry_sees_what_the_ledger_holds() -> None:
    """No fold is asked for: the registry's first collector folds before the series are read."""
    metrics = Metrics(CollectorRegistry())
    book = metrics.ledger.book(metrics.requests.observe_calls)
    book.add(("ModelInfer", "OK", 0.0004, ""))
    book.add(("ModelInfer", "OK", 0.003, "0af7651916cd43dd8448eb211c80319c"))
    book.add(("ModelInfer", "INVALID_ARGUMENT", 0.0001, ""))
    get = metrics.registry.get_sample_value
    assert get("mha_requests_total", {"method": "ModelInfer", "code": "OK"}) == 2
    assert get("mha_requests_total", {"method": "ModelInfer", "code": "INVALID_ARGUMENT"}) == 1
    assert get("mha_request_duration_seconds_bucket", {"method": "ModelInfer", "le": "0.0005"}) == 2
    assert get("mha_request_duration_seconds_count", {"method": "ModelInfer"}) == 3
    exposition = generate_latest(metrics.registry).decode()
    assert "mha_requests_total" in exposition and metrics.ledger.waiting() == 0
    openmetrics = _openmetrics(metrics.registry)
    assert 'trace_id="0af7651916cd43dd8448eb211c80319c"' in openmetrics  # the traced call's exemplar


def _openmetrics(registry: CollectorRegistry) -> str:
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    return generate_openmetrics(registry).decode()


def test_batches_and_answers_fold_into_their_series() -> None:
    metrics = Metrics(CollectorRegistry())
    events = [
        BatchEvent(requests=1, rows=3, seqs=(4,), padded_tokens=0, formation_s=0.0, compute_s=0.002, backend="ort-cpu"),
        BatchEvent(requests=2, rows=5, seqs=(4, 2), padded_tokens=2, formation_s=0.001, compute_s=0.0, backend=""),
    ]
    events[1].error = RuntimeError("failed: counted by its requests' codes, not as a batch")
    metrics.requests.observe_batches([(event, "mha", "1") for event in events])
    metrics.requests.observe_answers("mha", "1", 12 + 7, [0.0002, 0.03])
    metrics.requests.observe_answers("mha", "2", 5, [0.001])  # another version: its own series
    metrics.requests.observe_answers("mha_sequence", "1", 3, [0.001])  # decode steps: the sequence model's
    get = metrics.registry.get_sample_value
    v1 = {"model": "mha", "version": "1"}
    assert get("mha_batch_size_count", v1) == 1 and get("mha_batch_size_bucket", {**v1, "le": "4.0"}) == 1
    assert get("mha_inference_duration_seconds_count", {"backend": "ort-cpu", **v1}) == 1
    assert get("mha_tokens_total", v1) == 19 and get("mha_queue_duration_seconds_count", v1) == 2
    assert get("mha_queue_duration_seconds_bucket", {**v1, "le": "0.00025"}) == 1
    assert get("mha_tokens_total", {"model": "mha", "version": "2"}) == 5
    assert get("mha_tokens_total", {"model": "mha_sequence", "version": "1"}) == 3
