"""Incremental decoding over Triton's sequence parameters: every step's answer is the last rows of
the model over the whole prefix (float64 reference), steps of different sequences share batches
exactly, and every bad case answers its documented status."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from export.layout import ModelFiles
from export.onnx_export import export_onnx
from export.step_graph import export_step_graphs
from model import MHAConfig
from model.checkpoint import init_weights, load_checkpoint
from model.reference import attention_view, relative_error
from service.backends.base import Backend, Step
from service.backends.ort import OrtCpuBackend
from service.backends.pytorch import ServedAttention, TorchBackend
from service.decode.control import SequenceControl
from service.decode.sequences import SequenceLimits, SequenceStore
from service.errors import InvalidInput, Overloaded, SequenceNotFound
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.grpc_codec import decode_infer_response, encode_infer_request
from tests.support import ComputeGate, ManualClock, ServerThread, make_settings

C = 32  # the small model: 4 heads, max_seq_len 64
GATE = ComputeGate(held=())  # the module server's compute hook: holds a compute when a test asks


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    settings = make_settings(small_model_dir, backend="ort-cpu", max_sequences=16)
    with ServerThread(
        settings, compute_hook=GATE
    ) as s:  # steps on the worker thread, so that concurrent steps share batches
        yield s


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def _step(x: np.ndarray, sequence_id: int | str, start: bool = False, end: bool = False) -> pb.ModelInferRequest:
    request = encode_infer_request(x)
    if isinstance(sequence_id, int):
        request.parameters["sequence_id"].int64_param = sequence_id
    else:
        request.parameters["sequence_id"].string_param = sequence_id
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    return request


def _reference_tail(model_dir: Path, prefix: np.ndarray, t: int) -> torch.Tensor:
    config, weights = load_checkpoint(model_dir / "weights.safetensors")
    return attention_view(torch.from_numpy(prefix), weights, config)[:, -t:]


def _drive(stub, model_dir: Path, sequence_id: int | str, chunks: list[int], B: int, seed: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Send a sequence in chunks of t tokens; the relative error of each answer."""
    rng = np.random.default_rng(seed)
    prefix = np.zeros((B, 0, C), np.float32)
    errors = []
    for i, t in enumerate(chunks):
        x = rng.standard_normal((B, t, C), dtype=np.float32)
        prefix = np.concatenate([prefix, x], axis=1)  # (B, P + t, C)
        response = stub.ModelInfer(_step(x, sequence_id, start=i == 0, end=i == len(chunks) - 1), timeout=30)
        y = decode_infer_response(response)
        assert y.shape == (B, t, C)
        errors.append(relative_error(torch.from_numpy(y.copy()), _reference_tail(model_dir, prefix, t)))
    return errors


def test_eight_concurrent_sequences_are_exact_step_by_step(server: ServerThread, small_model_dir: Path) -> None:
    rng = np.random.default_rng(0)
    plans = []
    for i in range(8):
        chunks = [int(rng.integers(1, 6))] + [1 if rng.random() < 0.6 else int(rng.integers(2, 5)) for _ in range(12)]
        plans.append((i + 1 if i % 2 else f"seq-{i}", chunks, 1 + i % 2))
    errors: list[float] = []
    failures: list[BaseException] = []
    barrier = threading.Barrier(len(plans))

    def run(plan: tuple[int | str, list[int], int], seed: int) -> None:
        with grpc.insecure_channel(server.url) as channel:
            barrier.wait()
            try:
                errors.extend(_drive(pb_grpc.GRPCInferenceServiceStub(channel), small_model_dir, *plan, seed=seed))
            except BaseException as exc:  # asserted below
                failures.append(exc)

    def batches() -> tuple[float, float]:  # (rows, batches) of mha_batch_size so far
        sample = server.registry.get_sample_value
        v1 = {"model": "mha_sequence", "version": "1"}  # the steps' batches
        return sample("mha_batch_size_sum", v1) or 0.0, sample("mha_batch_size_count", v1) or 0.0

    before, GATE.widest = batches(), 0
    steps = server.engine.loaded.decoder.steps
    # The first compute waits until other steps queue behind it, or until every sequence's first step
    # is in it or queued: one batch may take them all, and then none follows until it is answered.
    GATE.hold_next(lambda: steps.depth >= 2 or GATE.holding + steps.depth >= len(plans))
    threads = [threading.Thread(target=run, args=(plan, i)) for i, plan in enumerate(plans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures[:2]
    assert len(errors) == 8 * 13 and max(errors) < 1e-5
    rows, executed = (after - first for after, first in zip(batches(), before, strict=True))
    assert 0 < executed <= 8 * 13, "decode batches are in the batch metrics"
    assert rows >= executed and GATE.widest >= 2, "steps of different sequences never shared a batch"
    assert len(server.engine.loaded.decoder.sequences) == 0, "every sequence ended"


def test_a_step_with_nan_or_inf_is_refused_and_leaves_its_sequence_as_it_was(stub, small_model_dir: Path) -> None:
    rng = np.random.default_rng(9)
    prefix = rng.standard_normal((1, 3, C), dtype=np.float32)
    stub.ModelInfer(_step(prefix, 90, start=True), timeout=30)
    bad = np.ones((1, 2, C), np.float32)
    bad[0, 1, 5], bad[0, 0, 0] = np.nan, np.inf
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(_step(bad, 90), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the input holds 2 NaN or inf values" in (info.value.details() or "")
    with pytest.raises(grpc.RpcError) as info:  # a restart with them would have dropped the 3 tokens
        stub.ModelInfer(_step(bad, 90, start=True), timeout=30)
    assert "the input holds 2 NaN or inf values" in (info.value.details() or "")
    x = rng.standard_normal((1, 2, C), dtype=np.float32)  # the sequence goes on from its 3 tokens
    y = decode_infer_response(stub.ModelInfer(_step(x, 90, end=True), timeout=30))
    expected = _reference_tail(small_model_dir, np.concatenate([prefix, x], axis=1), 2)
    assert relative_error(torch.from_numpy(y.copy()), expected) < 1e-5


def test_restart_begins_again_and_end_frees(stub, small_model_dir: Path) -> None:
    assert max(_drive(stub, small_model_dir, 77, [3, 1, 1], B=1, seed=1)) < 1e-5
    assert max(_drive(stub, small_model_dir, 78, [5, 2], B=2, seed=2)[:1]) < 1e-5
    # restart 78 mid-way (its last step above ended it; start it twice without ending)
    x = np.ones((1, 4, C), np.float32)
    stub.ModelInfer(_step(x, 78, start=True))
    errors = _drive(stub, small_model_dir, 78, [2, 1, 1], B=1, seed=3)  # starts again: the old state is gone
    assert max(errors) < 1e-5


def _code(stub, request: pb.ModelInferRequest) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    return info.value.code(), info.value.details() or ""


def test_every_bad_step_answers_its_status(stub) -> None:
    x = np.ones((1, 2, C), np.float32)
    stub.ModelInfer(_step(x, 500, start=True))
    bad_id = encode_infer_request(x)
    bad_id.parameters["sequence_id"].double_param = 1.5
    empty = encode_infer_request(x)
    empty.parameters["sequence_id"].string_param = ""
    negative = encode_infer_request(x)
    negative.parameters["sequence_id"].int64_param = -3
    flag_only = encode_infer_request(x)
    flag_only.parameters["sequence_end"].bool_param = True
    cases = {
        "unknown": (_step(x, 404), grpc.StatusCode.NOT_FOUND, "start it again with sequence_start"),
        "end-unknown": (_step(x, 405, end=True), grpc.StatusCode.NOT_FOUND, "is not known"),
        "other-B": (_step(np.ones((2, 1, C), np.float32), 500), grpc.StatusCode.INVALID_ARGUMENT, "B = 1 rows"),
        "too-long": (_step(np.ones((1, 63, C), np.float32), 500), grpc.StatusCode.INVALID_ARGUMENT, "max_seq_len 64"),
        "double-id": (bad_id, grpc.StatusCode.INVALID_ARGUMENT, "an integer or a string, got a number"),
        "empty-id": (empty, grpc.StatusCode.INVALID_ARGUMENT, "1 to 128 characters"),
        "negative-id": (negative, grpc.StatusCode.INVALID_ARGUMENT, "expected an integer >= 1"),
        "flag-only": (flag_only, grpc.StatusCode.INVALID_ARGUMENT, "need a sequence_id"),
    }
    for name, (request, code, expected) in cases.items():
        got, message = _code(stub, request)
        assert (got, expected in message) == (code, True), (name, got, message)
    stub.ModelInfer(_step(np.ones((1, 62, C), np.float32), 500, end=True))  # 2 + 62 = max_seq_len: fits
    got, message = _code(stub, _step(x, 500))
    assert got == grpc.StatusCode.NOT_FOUND and "ended (sequence_end)" in message


def test_a_wrong_width_is_refused_before_any_state(stub) -> None:
    got, message = _code(stub, _step(np.ones((1, 2, C + 1), np.float32), 600, start=True))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "expected C = 32" in message
    got, _ = _code(stub, _step(np.ones((1, 2, C), np.float32), 600))
    assert got == grpc.StatusCode.NOT_FOUND


def _at(request: pb.ModelInferRequest, offset: int) -> pb.ModelInferRequest:
    request.parameters["sequence_offset"].int64_param = offset
    return request


def test_each_step_says_how_long_its_sequence_is_and_where_it_lives(stub, small_model_dir: Path) -> None:
    rng = np.random.default_rng(7)
    prefix = rng.standard_normal((1, 4, C), dtype=np.float32)
    first = stub.ModelInfer(_at(_step(prefix, "where", start=True), 0), timeout=30)
    assert first.parameters["sequence_length"].int64_param == 4
    assert first.parameters["replica"].string_param and first.parameters["worker"].int64_param == 0
    token = rng.standard_normal((1, 1, C), dtype=np.float32)
    second = stub.ModelInfer(_at(_step(token, "where"), 4), timeout=30)
    assert second.parameters["sequence_length"].int64_param == 5
    whole = np.concatenate([prefix, token], axis=1)  # (1, 5, C)
    error = relative_error(
        torch.from_numpy(decode_infer_response(second).copy()), _reference_tail(small_model_dir, whole, 1)
    )
    assert error < 1e-5
    stateless = stub.ModelInfer(encode_infer_request(token), timeout=30)
    assert "sequence_length" not in stateless.parameters


def test_a_step_against_a_state_that_is_not_the_clients_is_refused_and_changes_nothing(
    stub, small_model_dir: Path
) -> None:
    """The client believes the server holds 3 tokens (it restarted the sequence elsewhere with a
    shorter prefix, say); the server holds 5: computing would answer OK and wrong."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 6, C), dtype=np.float32)
    stub.ModelInfer(_at(_step(x[:, :5], "stale", start=True), 0), timeout=30)
    got, message = _code(stub, _at(_step(x[:, 5:], "stale"), 3))
    assert got == grpc.StatusCode.FAILED_PRECONDITION, (got, message)
    assert "sequence_offset is 3" in message and "holds 5 tokens" in message and "worker 0" in message
    answer = stub.ModelInfer(_at(_step(x[:, 5:], "stale"), 5), timeout=30)  # the state stayed at 5
    assert answer.parameters["sequence_length"].int64_param == 6
    error = relative_error(
        torch.from_numpy(decode_infer_response(answer).copy()), _reference_tail(small_model_dir, x, 1)
    )
    assert error < 1e-5


def test_bad_offsets_and_headers_are_refused(stub) -> None:
    x = np.ones((1, 1, C), np.float32)
    stub.ModelInfer(_step(x, "headed", start=True), metadata=(("mha-sequence-id", "headed"),), timeout=30)
    no_id = _at(encode_infer_request(x), 0)
    negative = _at(_step(x, "headed"), -1)
    typed = _step(x, "headed")
    typed.parameters["sequence_offset"].string_param = "1"
    cases = {
        "offset-without-id": (no_id, (), "need a sequence_id"),
        "negative-offset": (negative, (), "expected a token count >= 0"),
        "string-offset": (typed, (), "must be an integer token count, got a string"),
        "start-at-3": (_at(_step(x, "other", start=True), 3), (), "a sequence starts at offset 0"),
        "header-differs": (_step(x, "headed"), (("mha-sequence-id", "other"),), "disagrees with the request's"),
        "header-alone": (encode_infer_request(x), (("mha-sequence-id", "headed"),), "sequence_id (none)"),
    }
    for name, (request, metadata, expected) in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, metadata=metadata, timeout=30)
        got, message = info.value.code(), info.value.details() or ""
        assert (got, expected in message) == (grpc.StatusCode.INVALID_ARGUMENT, True), (name, got, message)
    answer = stub.ModelInfer(_at(_step(x, "headed"), 1), metadata=(("mha-sequence-id", "headed"),), timeout=30)
    assert answer.parameters["sequence_length"].int64_param == 2  # none of the refused steps counted


# The pieces, without gRPC: the runner's batches across past lengths, and the store's limits.


def _backend(model_dir: Path, name: str, config: MHAConfig | None = None, weights: dict | None = None) -> Backend:
    """A backend that computes decode steps: torch on the CPU or CUDA, or ORT-CPU on the step graphs."""
    if config is None or weights is None:
        config, weights = load_checkpoint(model_dir / "weights.safetensors")
    if name == "ort-cpu":
        steps = ModelFiles(model_dir).steps
        return OrtCpuBackend(model_dir / "model.onnx", threads=2, width=config.d_model, step_paths=steps)
    return TorchBackend(config, weights, device="cuda" if name == "torch-cuda" else "cpu")


def _run_on(backend: Backend):  # type: ignore[no-untyped-def]
    """What the engine hands the step batcher: steps -> (outputs, the backend)."""

    def run(steps):  # type: ignore[no-untyped-def]
        return backend.step(steps), backend

    return run


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.py runs it)")
STEP_BACKENDS = ["torch-cpu", "ort-cpu", pytest.param("torch-cuda", marks=[CUDA, pytest.mark.gpu])]


@pytest.mark.parametrize("name", STEP_BACKENDS)
def test_a_batch_that_mixes_past_lengths_equals_each_sequence_alone(small_model_dir: Path, name: str) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    backend = _backend(small_model_dir, name)
    clock = ManualClock()
    store = SequenceStore(config, SequenceLimits(), clock.now, device=backend.device)
    rng = np.random.default_rng(4)
    pasts, news = [0, 5, 17, 40], [3, 1, 6, 2]
    prefixes, sequences = [], []
    for i, (P, t) in enumerate(zip(pasts, news, strict=True)):
        sequence = store.open(SequenceControl(i, start=True), 1 + i % 2, C)
        prefix = rng.standard_normal((sequence.rows, P + t, C), dtype=np.float32)
        if P:  # bring it to P tokens, alone
            store.check_room(sequence, P)
            backend.step([Step(sequence, prefix[:, :P])])
            sequence.length += P
        store.check_room(sequence, t)
        prefixes.append(prefix)
        sequences.append(sequence)
    steps = [Step(s, p[:, -t:]) for s, p, t in zip(sequences, prefixes, news, strict=True)]
    assert all(s.keys.device.type == backend.device.split(":")[0] for s in sequences)
    batched = backend.step(steps)  # one call: four sequences at past 0, 5, 17 and 40
    for y, prefix, t in zip(batched, prefixes, news, strict=True):
        reference = attention_view(torch.from_numpy(prefix), weights, config)[:, -t:]
        assert relative_error(torch.from_numpy(y.copy()), reference) < 1e-5
    alone = [backend.step([step])[0] for step in steps]  # nothing was committed: the same again, alone
    for y, y_alone in zip(batched, alone, strict=True):
        np.testing.assert_allclose(y, y_alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["torch-cpu", "ort-cpu"])
@pytest.mark.parametrize("bias", [True, False])
def test_one_token_steps_are_exact_token_by_token(tmp_path: Path, name: str, bias: bool) -> None:
    """A lone sequence's one-token steps over 70 tokens: the cache grows past its first capacity
    on the way, B = 2 rows; each output against the float64 reference of the whole prefix, and
    the keys the step wrote against the module's."""
    config = MHAConfig(d_model=48, n_head=6, max_seq_len=80, bias=bias)
    weights = init_weights(config, seed=21)
    export_step_graphs(config, weights, ModelFiles(tmp_path).steps)
    export_onnx(config, weights, tmp_path / "model.onnx")
    backend = _backend(tmp_path, name, config, weights)
    store = SequenceStore(config, SequenceLimits(), ManualClock().now)
    x = np.random.default_rng(8).standard_normal((2, 70, config.d_model), dtype=np.float32)
    reference = attention_view(torch.from_numpy(x), weights, config)  # (2, 70, C), float64
    sequence = store.open(SequenceControl("tokens", start=True), 2, config.d_model)
    outputs = []
    for i in range(70):
        store.check_room(sequence, 1)
        (y,) = backend.step([Step(sequence, x[:, i : i + 1])])
        sequence.length += 1
        outputs.append(y)
    assert relative_error(torch.from_numpy(np.concatenate(outputs, axis=1)), reference) < 1e-5
    _, keys, _ = ServedAttention.from_weights(config, weights).project(torch.from_numpy(x))  # (2, nh, 70, hs)
    assert torch.allclose(sequence.keys[:, :, :70], keys, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["torch-cpu", "ort-cpu"])
def test_a_step_with_inf_or_nan_answers_nan_without_a_warning(small_model_dir: Path, name: str) -> None:
    """A client's inf meets inf - inf inside attention: NaN comes out, for the commit to refuse
    (INVALID_ARGUMENT, the sequence as it was), and nothing is printed on the server's stderr."""
    config, _ = load_checkpoint(small_model_dir / "weights.safetensors")
    backend = _backend(small_model_dir, name)
    store = SequenceStore(config, SequenceLimits(), ManualClock().now)
    sequence = store.open(SequenceControl("hostile", start=True), 1, C)
    store.check_room(sequence, 1)
    for bad in (np.inf, np.nan, -np.inf):
        x = np.ones((1, 1, C), np.float32)
        x[0, 0, 3] = bad
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (y,) = backend.step([Step(sequence, x)])
        assert not np.isfinite(y).all()
    assert sequence.length == 0


def test_idle_sequences_are_evicted_and_say_so(small_model_dir: Path) -> None:
    config, _ = load_checkpoint(small_model_dir / "weights.safetensors")
    clock = ManualClock()
    evictions: list[str | None] = []
    store = SequenceStore(config, SequenceLimits(idle_timeout_s=10), clock.now, lambda s, r, gone: evictions.append(r))
    store.open(SequenceControl(1, start=True), 1, C)
    clock.advance(5)
    store.touch(store.open(SequenceControl(2, start=True), 1, C))
    clock.advance(6)  # 1 has idled 11 s, 2 only 6 s
    with pytest.raises(SequenceNotFound, match="evicted after 10 s idle"):
        store.open(SequenceControl(1), 1, C)
    assert store.open(SequenceControl(2), 1, C).id == 2
    assert evictions.count("idle") == 1


def test_a_sequence_is_reported_gone_when_it_ends_or_is_evicted_not_when_it_restarts(small_model_dir: Path) -> None:
    """What releases its ownership among workers: a restart keeps the id live here."""
    config, _ = load_checkpoint(small_model_dir / "weights.safetensors")
    clock = ManualClock()
    gone: list[object] = []
    store = SequenceStore(config, SequenceLimits(idle_timeout_s=10), clock.now, lambda s, r, g: gone.append(g))
    store.open(SequenceControl("a", start=True), 1, C)
    store.open(SequenceControl("a", start=True), 1, C)  # restarted
    store.end(store.open(SequenceControl("b", start=True), 1, C))
    assert [g for g in gone if g is not None] == ["b"]
    clock.advance(11)
    store.expire_idle()
    assert [g for g in gone if g is not None] == ["b", "a"]


def test_a_backend_distrusted_drops_exactly_the_sequences_it_computed(small_model_dir: Path) -> None:
    """`drop(why, written_by)`: every live sequence with a step that backend computed goes, saying
    why, and is reported gone; the others stay. Without a backend (shutdown) every one goes."""
    config, _ = load_checkpoint(small_model_dir / "weights.safetensors")
    gone: list[object] = []
    store = SequenceStore(config, SequenceLimits(), ManualClock().now, lambda s, r, g: gone.append(g))
    writers = {"a": {"ort-cpu"}, "b": {"torch-cpu"}, "c": {"torch-cpu", "ort-cpu"}, "d": set()}
    for name, backends in writers.items():
        store.open(SequenceControl(name, start=True), 1, C).writers.update(backends)
    assert store.drop("was dropped (ort-cpu found wrong)", written_by="ort-cpu") == 2
    assert [g for g in gone if g is not None] == ["a", "c"]
    assert store.holds("b") and store.holds("d") and not store.holds("a")
    with pytest.raises(SequenceNotFound, match=r"sequence 'c' was dropped \(ort-cpu found wrong\) on "):
        store.open(SequenceControl("c"), 1, C)
    assert store.drop("was dropped at shutdown") == 2 and len(store) == 0


def test_the_budget_evicts_idle_sequences_and_refuses_when_all_are_busy(small_model_dir: Path) -> None:
    config, _ = load_checkpoint(small_model_dir / "weights.safetensors")
    clock = ManualClock()
    one = 2 * config.d_model * 16 * 4  # a new sequence's cache: 16 positions of keys and values, B = 1
    store = SequenceStore(config, SequenceLimits(max_sequences=2, max_state_bytes=2 * one), clock.now)
    first = store.open(SequenceControl(1, start=True), 1, C)
    clock.advance(1)
    second = store.open(SequenceControl(2, start=True), 1, C)
    clock.advance(1)
    store.open(SequenceControl(3, start=True), 1, C)  # room for 3: the least recently used (1) goes
    assert not first.live and second.live
    with pytest.raises(SequenceNotFound, match="state budget"):
        store.open(SequenceControl(1), 1, C)

    async def all_busy() -> None:
        async with store.open(SequenceControl(2), 1, C).lock, store.open(SequenceControl(3), 1, C).lock:
            with pytest.raises(Overloaded, match="every sequence is stepping"):
                store.open(SequenceControl(4, start=True), 1, C)

    import asyncio

    asyncio.run(all_busy())
    with pytest.raises(InvalidInput, match="not causal"):
        SequenceStore(MHAConfig(d_model=32, n_head=4, causal=False), SequenceLimits(), clock.now).open(
            SequenceControl(1, start=True), 1, C
        )


def test_an_idle_sequence_is_evicted_without_traffic_and_the_gauges_follow(small_model_dir: Path) -> None:
    clock = ManualClock()
    settings = make_settings(small_model_dir, backend="torch", sequence_idle_timeout_s=30)
    with ServerThread(settings, clock=clock) as server, grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.ModelInfer(_step(np.ones((2, 5, C), np.float32), 9, start=True), timeout=30)
        gauge = lambda name: server.registry.get_sample_value(name)  # noqa: E731
        assert gauge("mha_sequences_active") == 1
        assert gauge("mha_sequence_state_bytes") == 2 * 2 * C * 16 * 4  # keys and values, B = 2, 16 positions
        clock.advance(31)  # no request arrives: the periodic expiry evicts it
        deadline = time.monotonic() + 10
        while gauge("mha_sequences_active") != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gauge("mha_sequences_active") == 0 and gauge("mha_sequence_state_bytes") == 0
        assert server.registry.get_sample_value("mha_sequence_evictions_total", {"reason": "idle"}) == 1
        got, message = _code(stub, _step(np.ones((2, 1, C), np.float32), 9))
        assert got == grpc.StatusCode.NOT_FOUND and "evicted after 30 s idle" in message


def test_steps_sent_before_the_previous_is_answered_queue_in_arrival_order(
    server: ServerThread, small_model_dir: Path
) -> None:
    """A stream carries 12 steps of one sequence at once; the server serves a stream's requests
    concurrently, so they all wait on the sequence: each must see exactly the steps before it."""
    rng = np.random.default_rng(11)
    tokens = rng.standard_normal((1, 12, C), dtype=np.float32)
    requests = [_step(tokens[:, i : i + 1], "burst", start=i == 0, end=i == 11) for i in range(12)]
    for i, request in enumerate(requests):
        request.id = str(i)
    with grpc.insecure_channel(server.url) as channel:
        responses = list(pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests), timeout=60))
    assert [r.error_message for r in responses] == [""] * 12
    for response in responses:
        i = int(response.infer_response.id)
        y = decode_infer_response(response.infer_response)
        assert (
            relative_error(torch.from_numpy(y.copy()), _reference_tail(small_model_dir, tokens[:, : i + 1], 1)) < 1e-5
        )


def test_a_failed_step_leaves_its_sequence_as_it_was(small_model_dir: Path) -> None:
    """The compute fails once (a lost device, say): that step answers its error, nothing is added
    to the sequence, and the same step sent again is exact."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from service.decode.scheduler import Decoder, StepBatcher

    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    run = _run_on(_backend(small_model_dir, "torch-cpu"))
    calls: list[int] = []

    def flaky(steps):  # type: ignore[no-untyped-def]
        calls.append(len(steps))
        if len(calls) == 2:  # the second compute fails
            raise RuntimeError("device lost")
        return run(steps)

    x = np.random.default_rng(2).standard_normal((1, 5, C), dtype=np.float32)

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            clock = ManualClock()
            decoder = Decoder(SequenceStore(config, SequenceLimits(), clock.now), StepBatcher(flaky, pool, 8))
            decoder.start(expiry_period_s=60)
            await decoder.step(SequenceControl(1, start=True), x[:, :3])
            with pytest.raises(RuntimeError, match="device lost"):
                await decoder.step(SequenceControl(1), x[:, 3:])
            assert decoder.sequences.open(SequenceControl(1), 1, C).length == 3
            stepped = await decoder.step(SequenceControl(1), x[:, 3:])
            assert stepped.length == 5
            reference = attention_view(torch.from_numpy(x), weights, config)[:, 3:]
            assert relative_error(torch.from_numpy(stepped.y.copy()), reference) < 1e-5
            await decoder.close()

    asyncio.run(scenario())


def test_an_ended_sequence_gives_its_keys_and_values_back_with_its_last_answer(small_model_dir: Path) -> None:
    """Ending a sequence frees its memory at once: nothing, the step engine's last batch included,
    keeps its keys and values until some later step of another sequence comes (on a GPU, memory the
    gauges already count as free)."""
    import asyncio
    import gc
    import weakref
    from concurrent.futures import ThreadPoolExecutor

    from service.decode.scheduler import Decoder, StepBatcher

    config, _ = load_checkpoint(small_model_dir / "weights.safetensors")
    run = _run_on(_backend(small_model_dir, "torch-cpu"))
    x = np.random.default_rng(3).standard_normal((1, 5, C), dtype=np.float32)

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            decoder = Decoder(SequenceStore(config, SequenceLimits(), ManualClock().now), StepBatcher(run, pool, 8))
            decoder.start(expiry_period_s=60)
            first = await decoder.step(SequenceControl(1, start=True), x[:, :3])
            held = [weakref.ref(first.sequence.keys), weakref.ref(first.sequence.values)]  # (1, nh, cap, hs)
            del first
            last = await decoder.step(SequenceControl(1, end=True), x[:, 3:])
            assert last.length == 5 and not last.sequence.live
            del last
            # The pool's thread lets go of a computed batch just after handing its answer over, when
            # it next runs: a call queued behind it ends only once it has.
            await asyncio.get_running_loop().run_in_executor(pool, int)
            gc.collect()
            assert [ref() for ref in held] == [None, None], "an ended sequence's cache is still held"
            await decoder.close()

    asyncio.run(scenario())


def test_a_client_moved_between_replicas_and_back_never_gets_a_wrong_answer(
    server: ServerThread, small_model_dir: Path
) -> None:
    """What a balancer that rehashes does to a sequence: steps 0-5 on replica A, 6-11 on B, 12-17
    on A again, where A still holds the state of step 5. MHAClient's sequence sends its offset, so
    B answers NOT_FOUND and A answers FAILED_PRECONDITION, each once, and the client restarts with
    its prefix; every answer is exact."""
    from service.client.client import MHAClient

    rng = np.random.default_rng(11)
    settings = make_settings(small_model_dir, backend="ort-cpu")
    with ServerThread(settings) as other, MHAClient(server.url) as a, MHAClient(other.url) as b:
        sequence = a.sequence("moved")
        whole = np.zeros((1, 0, C), np.float32)
        for i in range(18):
            sequence.client = b if 6 <= i < 12 else a
            x = rng.standard_normal((1, 2 if i == 0 else 1, C), dtype=np.float32)
            whole = np.concatenate([whole, x], axis=1)  # (1, P + t, C)
            y = sequence.send(x)
            tail = _reference_tail(small_model_dir, whole, x.shape[1])
            assert relative_error(torch.from_numpy(y.copy()), tail) < 1e-5, i
            assert sequence.length == whole.shape[1]
        assert sequence.restarts == 2


def test_require_sequence_offset_refuses_a_step_that_does_not_say_it(small_model_dir: Path) -> None:
    x = np.random.default_rng(9).standard_normal((1, 3, C), dtype=np.float32)
    settings = make_settings(small_model_dir, backend="torch", require_sequence_offset=True)
    with ServerThread(settings) as server, grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def step(x: np.ndarray, start: bool, offset: int | None) -> pb.ModelInferResponse:
            request = encode_infer_request(x)
            request.parameters["sequence_id"].string_param = "strict"
            request.parameters["sequence_start"].bool_param = start
            if offset is not None:
                request.parameters["sequence_offset"].int64_param = offset
            return stub.ModelInfer(request, timeout=10)

        step(x[:, :1], start=True, offset=None)  # a start needs no offset: it holds nothing yet
        with pytest.raises(grpc.RpcError) as info:
            step(x[:, 1:2], start=False, offset=None)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "send the number of tokens sent before this step" in info.value.details()
        assert step(x[:, 1:2], start=False, offset=1).parameters["sequence_length"].int64_param == 2
