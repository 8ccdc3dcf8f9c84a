"""`mha verify DIR --url`: a running server's answers, on every route it offers, against the float64
references of the weights in DIR.

A route is a way in that has code of its own between the wire and the model: unary gRPC, the
rows of many requests merged into the server's batches and split back, a gRPC stream, decode
steps of a sequence (the prefix, then steps of 1, 2, 3, ... tokens, each answer the rows of the
whole sequence so far), the same steps each on a new connection (with several workers, most are
handed over to the worker that holds the sequence), system shared memory where the server offers
it and runs on this host, and with `--http-url`, HTTP with JSON tensors, with Triton's binary-data
extension, and a sequence's steps. Each route is checked over the same grid of shapes and seeded
inputs; a route that refuses a request fails with the server's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import ssl
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np

from export.layout import ModelFiles, precision_tolerance
from export.verify import ParityReport, check_parity_of, parity_inputs, sha256_file
from model.checkpoint import load_checkpoint
from service.client.client import InferenceError, MHAClient
from service.client.local_routes import (
    NOT_HERE,
    SharedMemoryRoute,
    Step,
    on_new_connections,
    on_this_host,
    why_not_checked,
)
from service.protocol.http_codec import HEADER_LENGTH
from service.protocol.inference import SEQUENCE_HEADER, SEQUENCE_OFFSET

log = logging.getLogger(__name__)
Runner = Callable[[np.ndarray], np.ndarray]
HTTP_TIMEOUT_S = 60.0
SEED = 7  # the grid's inputs, the same on every route
BATCHED_AT_ONCE = 32  # rows in flight at once on the batched route
RECONNECTED = "gRPC steps, reconnecting"  # each step on a new connection: with workers, most handed over
ROUTE_WIDTH = 24  # the table's first column: the longest name
SHARED_MEMORY = "gRPC shared memory"  # Triton's system shared memory, for clients on the server's host


def server_parity_grid(max_seq_len: int) -> list[tuple[int, int]]:
    """Many shapes for end-to-end checks: T = 1, primes, powers of two, max_seq_len; B from 1 to 5,
    but 1 at max_seq_len, where the references' B x heads x T x T scores in float64 set the check's
    memory (1.1 GB at B = 5 for the default model, more than `helm test`'s pod may use)."""
    seqs = sorted({min(t, max_seq_len) for t in (1, 2, 3, 7, 16, 31, 64, 127, max_seq_len // 2 + 1, max_seq_len)})
    return [(1 if t == max_seq_len else 1 + i % 5, t) for i, t in enumerate(seqs)]


@dataclass(frozen=True)
class HttpAccess:
    """How to reach the server's HTTP port: its URL (http:// or https://), and for HTTPS the CA, the
    client's certificate and key (mTLS) and the name to check the certificate for."""

    url: str
    token: str | None = None
    ca: Path | None = None
    client_cert: tuple[Path, Path] | None = None  # (certificate, key)
    server_name: str | None = None

    def context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https://"):
            return None
        context = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        if self.client_cert is not None:
            context.load_cert_chain(str(self.client_cert[0]), str(self.client_cert[1]))
        return context


class HttpRefused(RuntimeError):
    """An HTTP inference answered with an error status, or not at all in time; the message says which."""


REFUSALS = (InferenceError, HttpRefused, aiohttp.ClientError)  # a route that answers with an error


class HttpRoute:
    """KServe v2 inference over HTTP, for checks: JSON tensors, or the binary-data extension; a
    sequence's steps as JSON parameters. One keep-alive connection, as a client would hold, so
    that a sequence's steps stay with the replica that holds it behind a Service."""

    def __init__(self, access: HttpAccess, model: str, version: str, input_name: str, output_name: str) -> None:
        self.access, self.names = access, (input_name, output_name)
        versioned = f"/versions/{version}" if version else ""
        self.path = f"{access.url.rstrip('/')}/v2/models/{model}{versioned}/infer"
        self._context = access.context()
        self._loop = asyncio.new_event_loop()
        self._session = self._loop.run_until_complete(_session())

    def close(self) -> None:
        self._loop.run_until_complete(self._session.close())
        self._loop.close()

    def infer(self, x: np.ndarray, binary: bool) -> np.ndarray:
        """(B, T, C) -> (B, T, C) float32."""
        body, headers = self._binary_request(x) if binary else self._json_request(x, {})
        answer_headers, answer = self._post(body, headers)
        return _binary_output(answer_headers, answer) if binary else _json_output(answer)

    def step(self, sequence_id: str, x: np.ndarray, offset: int, start: bool, end: bool) -> np.ndarray:
        """One step of a sequence: (B, t, C) new tokens -> their (B, t, C) outputs."""
        parameters = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
        body, headers = self._json_request(x, {**parameters, SEQUENCE_OFFSET: offset})
        _, answer = self._post(body, {**headers, SEQUENCE_HEADER: sequence_id})
        return _json_output(answer)

    def routes(self, causal: bool) -> dict[str, Runner]:
        """HTTP's routes, by name: JSON, binary data, and a sequence's steps (a causal model's)."""
        runs: dict[str, Runner] = {
            "HTTP JSON": lambda x: self.infer(x, binary=False),
            "HTTP binary data": lambda x: self.infer(x, binary=True),
        }
        if causal:
            runs["HTTP decode steps"] = _stepped(self.step)
        return runs

    def _post(self, body: bytes, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
        if self.access.token:
            headers = {**headers, "Authorization": f"Bearer {self.access.token}"}
        try:
            status, answer_headers, answer = self._loop.run_until_complete(self._send(body, headers))
        except TimeoutError as exc:
            raise HttpRefused(f"no answer within {HTTP_TIMEOUT_S:g} s") from exc
        if status != 200:
            raise HttpRefused(f"HTTP {status}: {_reason(answer)}")
        return answer_headers, answer

    async def _send(self, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        ssl_option: ssl.SSLContext | bool = self._context if self._context is not None else False
        async with self._session.post(
            self.path, data=body, headers=headers, ssl=ssl_option, server_hostname=self.access.server_name
        ) as response:
            headers = {name.lower(): value for name, value in response.headers.items()}  # as HTTP/2 proxies send them
            return response.status, headers, await response.read()

    def _tensor(self, x: np.ndarray) -> dict[str, Any]:
        return {"name": self.names[0], "shape": list(x.shape), "datatype": "FP32"}

    def _json_request(self, x: np.ndarray, parameters: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        tensor = {**self._tensor(x), "data": x.ravel().tolist()}  # (B * T * C,) row-major
        request = {"inputs": [tensor], **({"parameters": parameters} if parameters else {})}
        return json.dumps(request).encode(), {"Content-Type": "application/json"}

    def _binary_request(self, x: np.ndarray) -> tuple[bytes, dict[str, str]]:
        raw = np.ascontiguousarray(x, dtype="<f4").tobytes()
        tensor = {**self._tensor(x), "parameters": {"binary_data_size": len(raw)}}
        output = {"name": self.names[1], "parameters": {"binary_data": True}}
        header = json.dumps({"inputs": [tensor], "outputs": [output]}).encode()
        return header + raw, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}


async def _session() -> aiohttp.ClientSession:
    """A session of the route's own event loop (aiohttp binds it to the loop it is made in); a
    request answered within a minute, as `MHAClient.infer` waits for gRPC's (aiohttp's own default
    is five)."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))


def _reason(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])[:300]
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace")


def _json_output(body: bytes) -> np.ndarray:
    (output,) = json.loads(body)["outputs"]
    return np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])  # (B, T, C)


def _binary_output(headers: dict[str, str], body: bytes) -> np.ndarray:
    length = int(headers[HEADER_LENGTH.lower()])
    (output,) = json.loads(body[:length])["outputs"]
    raw = body[length : length + output["parameters"]["binary_data_size"]]
    return np.frombuffer(raw, dtype="<f4").reshape(output["shape"])  # (B, T, C)


def _streamed(client: MHAClient) -> Runner:
    """Each input alone on a ModelStreamInfer stream of its own."""
    return lambda x: next(iter(client.stream_infer([x])))


def _stepped(step: Step) -> Runner:
    """Each input as a sequence: its first half (at least one token) with sequence_start, then steps
    of 1, 2, 3, ... tokens, the last with sequence_end; the answers side by side."""
    ids = (f"mha-verify-{uuid.uuid4().hex[:12]}-{n}" for n in itertools.count())

    def run(x: np.ndarray) -> np.ndarray:
        sequence_id, seq = next(ids), x.shape[1]
        cuts = [0, max(1, seq // 2)]
        for size in itertools.count(1):
            if cuts[-1] >= seq:
                break
            cuts.append(min(seq, cuts[-1] + size))
        answers = [step(sequence_id, x[:, a:b], a, a == 0, b == seq) for a, b in itertools.pairwise(cuts)]
        return np.concatenate(answers, axis=1)  # (B, T, C): each step's (B, b - a, C) side by side

    return run


class Batched:
    """A route of its own: every row of every input sent at once, each row a request of its own on
    one channel, so that the server merges rows of different requests (and lengths within its
    padding bound) into its batches and splits them back. The first call sends them all; each call
    then gives one input's rows put back together, in the order the inputs come."""

    def __init__(self, client: MHAClient, inputs: list[np.ndarray]) -> None:
        self.client, self.inputs = client, inputs
        self.answers: list[np.ndarray] | None = None
        self.calls = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.answers is None:
            self.answers = self._send_all()
        expected, answer = self.inputs[self.calls], self.answers[self.calls]
        self.calls += 1
        if not np.array_equal(x, expected):
            raise ValueError("the parity check sent another input than the batched route computed")
        return answer

    def _send_all(self) -> list[np.ndarray]:
        rows = [(i, b) for i, x in enumerate(self.inputs) for b in range(x.shape[0])]
        with ThreadPoolExecutor(max_workers=min(BATCHED_AT_ONCE, len(rows))) as pool:
            answered = list(pool.map(lambda row: self.client.infer(self.inputs[row[0]][row[1] : row[1] + 1]), rows))
        by_input: list[list[np.ndarray]] = [[] for _ in self.inputs]
        for (i, _), y in zip(rows, answered, strict=True):
            by_input[i].append(y)  # (1, T, C), rows in order
        return [np.concatenate(ys, axis=0) for ys in by_input]  # (B, T, C) each


def _grpc_routes(client: MHAClient, causal: bool, inputs: list[np.ndarray]) -> dict[str, Runner]:
    """gRPC's routes, by name: unary, its rows batched with others', a stream, and a sequence's
    steps (a causal model's)."""
    runs: dict[str, Runner] = {
        "gRPC ModelInfer": client.infer,
        "gRPC rows batched": Batched(client, inputs),
        "gRPC ModelStreamInfer": _streamed(client),
    }
    if causal:
        runs["gRPC decode steps"] = _stepped(lambda i, x, offset, start, end: client.step(i, x, offset, start, end).y)
    return runs


def _local_routes(
    client: MHAClient, url: str, causal: bool, client_kwargs: dict[str, Any], skipped: dict[str, str]
) -> dict[str, Runner]:
    """The routes only a client on the server's host checks, by name; why one is not, in `skipped`."""
    runs: dict[str, Runner] = {}
    if causal and on_this_host(url):
        runs[RECONNECTED] = _stepped(on_new_connections(url, client, client_kwargs))
    elif causal:
        skipped[RECONNECTED] = f"{NOT_HERE} (through a Service, a new connection may reach another replica)"
    if (why := why_not_checked(client, url)) is None:
        runs[SHARED_MEMORY] = SharedMemoryRoute(client)
    else:
        skipped[SHARED_MEMORY] = why
    return runs


@dataclass
class RoutesReport:
    """Each route's parity report, the routes not checked and why, and what is wrong whatever the
    answers (the server serves other weights than DIR's)."""

    routes: dict[str, ParityReport] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(report.ok for report in self.routes.values())

    def to_dict(self) -> dict[str, object]:
        """The report as JSON takes it (`mha verify --json`): for pipelines that gate on it."""
        routes = {route: {**report.to_dict(), "problems": report.failures()} for route, report in self.routes.items()}
        return {"ok": self.ok, "routes": routes, "not_checked": self.skipped, "problems": self.problems}

    def table(self) -> str:
        """One line per route; the whole grid of a route that failed, to say where."""
        lines = [f"{'route':<{ROUTE_WIDTH}} {'result':<6} {'shapes':>6} {'worst rel. error':>17} {'tolerance':>10}"]
        for route, report in self.routes.items():
            worst = f"{max(row.worst for row in report.rows):.2e}" if report.rows else "-"
            verdict = "ok" if report.ok else "FAIL"
            cells = f"{verdict:<6} {len(report.rows):>6} {worst:>17} {report.tolerance:>10.0e}"
            lines.append(f"{route:<{ROUTE_WIDTH}} {cells}")
        lines += [f"{route:<{ROUTE_WIDTH}} not checked: {why}" for route, why in self.skipped.items()]
        for route, report in self.routes.items():
            if not report.ok:
                lines += ["", f"{route}:", report.table()]
        lines += [f"problem: {problem}" for problem in self.problems]
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def verify_server(
    url: str,
    model_dir: Path,
    shapes: Sequence[tuple[int, int]] | None = None,
    http: HttpAccess | None = None,
    model: str = "mha",
    version: str = "",
    **client_kwargs: Any,
) -> RoutesReport:
    """End-to-end parity of a running server's routes against the float64 references: the
    `model`'s `version` (empty: the one the server serves by default)."""
    files = ModelFiles(model_dir)
    config, weights = load_checkpoint(files.weights)
    result = RoutesReport()
    with MHAClient(url, model=model, version=version, **client_kwargs) as client:
        parameters = client.model_config().parameters
        served_c = parameters["d_model"].string_value
        if served_c != str(config.d_model):
            raise InferenceError(
                grpc.StatusCode.FAILED_PRECONDITION, f"it serves C = {served_c}, {model_dir} holds C = {config.d_model}"
            )
        precision = parameters["precision"].string_value or "fp32"  # a server that does not say computes in fp32
        tolerance = precision_tolerance(precision, config)
        backend, device = parameters["backend"].string_value, parameters["device"].string_value
        log.info(
            "the server at %s answers with %s on %s in %s (tolerance %.1e)", url, backend, device, precision, tolerance
        )
        grid = shapes or server_parity_grid(config.max_seq_len)

        causal = parameters["causal"].string_value == "true"
        if not causal:
            result.skipped["decode steps"] = "the model is not causal: it serves no sequences"
        if http is None:
            result.skipped["HTTP"] = "give --http-url to check it"
        with contextlib.ExitStack() as stack:
            inputs = [x.numpy() for x in parity_inputs(config, grid, seed=SEED)]
            runs = _grpc_routes(client, causal, inputs)
            runs |= _local_routes(client, url, causal, client_kwargs, result.skipped)
            if http is not None:
                metadata = client.model_metadata()
                route = HttpRoute(http, model, version, metadata.inputs[0].name, metadata.outputs[0].name)
                stack.callback(route.close)
                runs |= route.routes(causal)
            result.routes = check_parity_of(runs, config, weights, grid, SEED, tolerance, refusals=REFUSALS)
        served = parameters["weights_sha256"].string_value
    local = sha256_file(files.weights)
    if served != local:
        result.problems.append(f"the server serves weights sha256 {served[:12]}..., {model_dir} holds {local[:12]}...")
    return result
