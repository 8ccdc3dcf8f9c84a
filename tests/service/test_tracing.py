"""Traces, exported over OTLP/HTTP to a real receiver in the test (opentelemetry-proto decodes
what the real exporter sends): the span tree of a call, a client's trace continued, one span per
batch linked both ways with its requests, decode steps, and off by default."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from service.client.client import MHAClient
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import encode_infer_request
from service.tracing import check_endpoints
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support import ROOT, ServerThread, make_settings

TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def _flush(server: ServerThread) -> None:
    assert server.engine.tracing.flush(), "the exporter did not deliver in time"


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan, name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name and s.parent_span_id == parent.span_id]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tritonclient_traceparent_is_continued_even_when_sampling_is_off(
    protocol: str, receiver: OtlpReceiver, small_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampler always_off, and the client's flags say "not sampled": a call that carries a
    traceparent is traced all the same (Triton's rule), under the client's trace and span."""
    assert TRITON_PYTHON.exists(), "make install creates .venv-triton with tritonclient"
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,k8s.pod.name=pod-7")
    settings = make_settings(small_model_dir, backend="torch", http_port=0, otlp_endpoint=receiver.endpoint)
    with ServerThread(settings) as server:
        url = server.url if protocol == "grpc" else f"127.0.0.1:{server.http_port}"
        traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
        script = str(Path(__file__).parents[1] / "e2e" / "triton_traced.py")
        subprocess.run([str(TRITON_PYTHON), script, protocol, url, traceparent], check=True, timeout=120)
        with MHAClient(server.url) as client:  # no traceparent: sampled out
            client.infer(np.ones((1, 2, 32), np.float32))
        _flush(server)
    calls = receiver.named("ModelInfer")
    assert len(calls) == 1, [(s.name, s.trace_id) for s in receiver.spans]
    call = calls[0]
    assert (call.trace_id, call.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert call.kind == 2  # SERVER
    assert call.attributes["rpc.method"] == "ModelInfer"
    if protocol == "grpc":
        assert call.attributes["mha.request_id"] == "traced-1"
        assert call.attributes["rpc.system"] == "grpc" and call.attributes["rpc.grpc.status_code"] == 0
    else:
        assert call.attributes["http.request.method"] == "POST" and call.attributes["http.response.status_code"] == 200
    resource = call.resource
    assert resource["service.name"] == "mha-serve" and resource["mha.model.name"] == "mha"
    assert resource["deployment.environment"] == "test" and resource["k8s.pod.name"] == "pod-7"  # the env's win
    (queue,) = _children(receiver.spans, call, "queue")
    assert call.start_ns <= queue.start_ns <= queue.end_ns <= call.end_ns
    (batch,) = receiver.named("batch")
    assert (CLIENT_TRACE, call.span_id) in batch.links and (batch.trace_id, batch.span_id) in call.links
    assert batch.attributes["mha.batch.requests"] == 1 and batch.attributes["mha.backend"] == "torch-cpu"
    assert {"mha.batch.rows", "mha.batch.padded_tokens"} <= batch.attributes.keys()


def test_a_batch_of_eight_is_one_span_linked_from_eight_request_spans(
    receiver: OtlpReceiver, small_model_dir: Path
) -> None:
    settings = make_settings(
        small_model_dir, backend="torch", max_batch_size=8, max_queue_delay_ms=10_000, otlp_endpoint=receiver.endpoint
    )
    with ServerThread(settings) as server:
        server.engine.requests.started()  # one more request in the server: the batcher waits for company
        try:
            barrier = threading.Barrier(8)

            def send(i: int) -> None:
                with MHAClient(server.url) as client:
                    barrier.wait(30)
                    client.infer(np.full((1, 3 + i % 2, 32), 0.1, np.float32), timeout=60)  # T 3 or 4

            threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
        finally:
            server.engine.requests.finished()
        _flush(server)
    calls = receiver.named("ModelInfer")
    batches = receiver.named("batch")
    assert len(batches) == 1, [b.attributes for b in batches]
    batch = batches[0]
    assert len(calls) == 8 and batch.attributes["mha.batch.requests"] == 8 and batch.attributes["mha.batch.rows"] == 8
    assert batch.attributes["mha.batch.padded_tokens"] == 4  # the four of T = 3 padded to 4
    assert sorted(batch.links) == sorted((c.trace_id, c.span_id) for c in calls)  # linked to each
    for call in calls:
        assert (batch.trace_id, batch.span_id) in call.links  # and each back to it
        assert len(_children(receiver.spans, call, "queue")) == 1
    assert len({c.trace_id for c in calls}) == 8  # eight traces (no traceparent: each its own root)


@pytest.mark.parametrize("entry", ["mha_sequence", "mha"])
def test_decode_steps_are_spans_with_their_sequence(receiver: OtlpReceiver, small_model_dir: Path, entry: str) -> None:
    settings = make_settings(small_model_dir, backend="torch", otlp_endpoint=receiver.endpoint)
    with ServerThread(settings) as server:
        with MHAClient(server.url, model=entry) as client:
            sequence = client.sequence(f"traced-seq-{entry}")
            sequence.send(np.ones((1, 3, 32), np.float32))
            sequence.send(np.ones((1, 1, 32), np.float32), end=True)
        _flush(server)
    steps = sorted(
        (s for s in receiver.named("decode step") if entry in s.attributes["mha.sequence_id"]), key=lambda s: s.start_ns
    )
    assert [(s.attributes["mha.step.tokens"], s.attributes["mha.sequence.tokens_held"]) for s in steps] == [
        (3, 3),
        (1, 4),
    ]
    assert all(f"traced-seq-{entry}" in s.attributes["mha.sequence_id"] for s in steps)
    calls = {c.span_id: c for c in receiver.named("ModelInfer")}
    assert all(s.parent_span_id in calls for s in steps)  # each inside its call's span


def test_off_by_default(small_model_dir: Path) -> None:
    with ServerThread(make_settings(small_model_dir, backend="torch")) as server:
        assert not server.engine.tracing.enabled
        with MHAClient(server.url) as client:
            client.infer(np.ones((1, 2, 32), np.float32))


def test_each_request_of_a_stream_is_a_span_and_nothing_logs_an_error(
    receiver: OtlpReceiver, small_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream's answers are counted (and their spans ended) once written, in the stream's task,
    not the request's: the span's context is detached where it was attached, with no error."""
    import logging

    settings = make_settings(small_model_dir, backend="torch", otlp_endpoint=receiver.endpoint)
    with ServerThread(settings) as server:
        with MHAClient(server.url) as client:
            outputs = list(client.stream_infer([np.ones((1, 2 + i, 32), np.float32) for i in range(5)]))
        with grpc.insecure_channel(server.url) as channel:  # and one cancelled after its first answer
            x = np.ones((8, 64, 32), np.float32)
            requests = (encode_infer_request(x, request_id=str(i)) for i in range(30))
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests, timeout=60)
            next(call)
            call.cancel()
        deadline = time.monotonic() + 30
        while server.engine.requests.count and time.monotonic() < deadline:
            time.sleep(0.02)
        _flush(server)
    assert len(outputs) == 5
    calls = receiver.named("ModelStreamInfer")
    assert sum(c.attributes["mha.code"] == "OK" for c in calls) >= 5, [c.attributes for c in calls]
    assert {c.attributes["mha.code"] for c in calls} <= {"OK", "CANCELLED"}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors


@pytest.mark.parametrize(
    ("endpoint", "environ", "refused"),
    [
        ("notaurl", {}, "--otlp-endpoint 'notaurl'"),
        ("http://:4318", {}, "--otlp-endpoint 'http://:4318'"),
        ("http://collector:port", {}, "--otlp-endpoint 'http://collector:port'"),
        ("ftp://collector:4318", {}, "--otlp-endpoint 'ftp://collector:4318'"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT 'collector:4318'"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http//c/v1/traces"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        ("http://collector:4318", {}, None),
        ("https://collector.example/otlp", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1]:4318"}, None),
    ],
)
def test_an_endpoint_that_is_not_an_http_url_is_refused_at_start(
    endpoint: str | None, environ: dict[str, str], refused: str | None
) -> None:
    """Before, --otlp-endpoint notaurl started a server whose exporter lost every span quietly."""
    if refused is None:
        check_endpoints(endpoint, environ)
        return
    with pytest.raises(ValueError, match=re.escape(refused) + ".*expected an OTLP/HTTP URL such as"):
        check_endpoints(endpoint, environ)


def test_a_hand_over_passes_on_the_trace_of_a_sampled_call_only() -> None:
    """What a call handed to another worker carries of its trace: a sampled call's traceparent
    (the other worker's part joins the trace); of a call not sampled, nothing, and the word that
    it is not traced (a traceparent, even unsampled, is a client's: that worker would record it);
    with no span current (tracing off), nothing, and it may be traced there as its own."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    from service.tracing import pass_trace_on

    for sampler, passed in ((ALWAYS_ON, True), (ALWAYS_OFF, False)):
        tracer = TracerProvider(sampler=sampler).get_tracer("test")
        with tracer.start_as_current_span("ModelInfer") as span:
            carrier: dict[str, str] = {}
            assert pass_trace_on(carrier) is passed
            trace_id = f"{span.get_span_context().trace_id:032x}"
        assert (carrier.get("traceparent", "").split("-")[1:2] == [trace_id]) is passed, carrier
        assert passed or carrier == {}
    carrier = {}
    assert pass_trace_on(carrier) and carrier == {}
