"""The books a publisher keeps by version: ModelStatistics' entries go when the version is forgotten."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from service.engine.publishing import Publisher, ServingBackends
from service.engine.readiness import DeviceHealth
from service.metrics import Metrics
from service.tracing import Tracing


def test_a_versions_statistics_go_when_its_series_are_forgotten() -> None:
    """A version unloaded for the metrics' grace is forgotten (with Metrics.forget): its statistics
    go, and a version loaded again counts from zero, as its series do; the others keep theirs."""
    metrics = Metrics(CollectorRegistry())
    serving = ServingBackends(metrics, DeviceHealth("any", metrics), lambda: True, lambda: None)
    publisher = Publisher(metrics, serving, Tracing())
    publisher.requests_closed([("1", False, "OK", 0.001), ("2", False, "OK", 0.002), ("1", True, "OK", 0.001)], "2")
    with publisher.statistics("1") as one, publisher.statistics("1", steps=True) as steps:
        assert (one.success.count, steps.success.count) == (1, 1)
    publisher.forget("1")
    with publisher.statistics("1") as one, publisher.statistics("1", steps=True) as steps:
        assert (one.success.count, steps.success.count) == (0, 0)
    with publisher.statistics("2") as two:
        assert two.success.count == 1
