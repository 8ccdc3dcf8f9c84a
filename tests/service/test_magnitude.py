"""No finite input is answered OK and wrong, on any backend or on the decode path: every answer is
within tolerance of the float64 reference, or INVALID_ARGUMENT. (PyTorch's CPU attention turned
rows of overflowing scores into zeros and answered o_proj's bias, OK, from values of about 1e20.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.checkpoint import load_checkpoint
from model.reference import attention_view, relative_error
from service.client.client import InferenceError, MHAClient
from service.engine.magnitude import magnitude_bound
from tests.support import ServerThread, make_settings

TOLERANCE = 1e-4  # float32 against float64, at every scale the server accepts


@pytest.fixture(scope="module", params=["torch", "ort-cpu"])
def server(request: pytest.FixtureRequest, small_model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_settings(small_model_dir, backend=request.param)) as s:
        yield s


def _exact_or_refused(call, x: np.ndarray, reference: torch.Tensor) -> str:  # type: ignore[no-untyped-def]
    try:
        y = call(x)
    except InferenceError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT, exc
        return "refused"
    error = relative_error(torch.from_numpy(np.ascontiguousarray(y)), reference)
    assert error < TOLERANCE, f"answered OK and wrong: relative error {error:.3g} at max |x| {np.abs(x).max():.3g}"
    return "answered"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(exponent=st.integers(0, 38), T=st.integers(1, 8), B=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_every_finite_input_is_answered_exactly_or_refused(
    server: ServerThread, small_model_dir: Path, exponent: int, T: int, B: int, seed: int
) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    normal = np.clip(np.random.default_rng(seed).standard_normal((B, T, config.d_model)), -3, 3)
    x = (normal * 10.0**exponent).astype(np.float32)  # up to 3e38: every value a finite float32
    assert np.isfinite(x).all()
    reference = attention_view(torch.from_numpy(x), weights, config)
    with MHAClient(server.url) as client:
        _exact_or_refused(client.infer, x, reference)
        sequence = client.sequence(f"magnitude-{seed}-{exponent}-{T}-{B}")
        _exact_or_refused(sequence.send, x, reference)  # the decode path, on its own cache
        if sequence.length:
            client.step(sequence.id, x[:, :1], sequence.length, end=True)


def test_the_values_that_broke_pytorch_are_refused_and_the_largest_accepted_are_exact(
    server: ServerThread, small_model_dir: Path
) -> None:
    config, weights = load_checkpoint(small_model_dir / "weights.safetensors")
    bound = magnitude_bound(config, weights)
    rng = np.random.default_rng(0)
    with MHAClient(server.url) as client:
        for T in (1, 2, 4):
            x = (rng.standard_normal((1, T, config.d_model)) * 1e20).astype(np.float32)
            with pytest.raises(InferenceError) as info:
                client.infer(x)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "scale the input down" in str(info.value)
            x = rng.standard_normal((1, T, config.d_model)).astype(np.float32)
            x *= np.float32(0.99 * bound.max_abs / np.abs(x).max())  # just under the bound: computed, exactly
            reference = attention_view(torch.from_numpy(x), weights, config)
            assert _exact_or_refused(client.infer, x, reference) == "answered"


def test_an_overflowing_input_cannot_make_the_server_check_itself(small_model_dir: Path) -> None:
    """With one backend, an output that overflowed used to be judged by re-running the whole
    self-check, batch after batch, as often as a client liked; such inputs are now refused first."""
    with ServerThread(make_settings(small_model_dir, backend="ort-cpu")) as server:
        chain = server.core.loaded.chain
        probes: list[str] = []
        probe = chain._probe
        chain._probe = lambda backend: probes.append(backend.name) or probe(backend)
        x = (np.random.default_rng(0).standard_normal((1, 4, 32)) * 1e20).astype(np.float32)
        with MHAClient(server.url) as client:
            for _ in range(5):
                with pytest.raises(InferenceError) as info:
                    client.infer(x)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert probes == []
