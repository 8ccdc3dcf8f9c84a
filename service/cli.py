"""`mha`: export, verify, serve, infer, bench."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import numpy as np

    from export.verify import ParityReport
    from model import MHAConfig
    from model.checkpoint import Weights
    from service.client.parity import HttpAccess, RoutesReport

log = logging.getLogger("mha")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from model import MHAConfig

    d = MHAConfig()
    p.add_argument("--d-model", type=int, default=None, help=f"C, the model width (default {d.d_model})")
    p.add_argument("--n-head", type=int, default=None, help=f"number of heads (default {d.n_head})")
    p.add_argument("--max-seq-len", type=int, default=None, help=f"longest T served (default {d.max_seq_len})")
    p.add_argument("--no-causal", action="store_true", help="unmasked (bidirectional) attention")
    p.add_argument("--no-bias", action="store_true", help="projections without bias")
    p.add_argument("--seed", type=int, default=None, help="seed for the default weights (default 0)")


def cmd_export(args: argparse.Namespace) -> int:
    """What the arguments get wrong is said before torch and onnx load (seconds)."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file: name a directory for the model's files", 2)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise CliError(
            f"--out {out} exists and is not empty (a server may be serving it); pass --force to replace it", 2
        )
    precisions = _precisions(args.precision)
    try:
        config, weights = _model_from_args(args)
    except ValueError as exc:  # a CheckpointError too
        log.error("cannot build the model: %s", exc)
        return 2
    from export.onnx_export import DEFAULT_OPSET, ExportError
    from export.pipeline import ParityError, export_model_dir

    try:
        report = export_model_dir(
            out, config, weights, opset=args.opset or DEFAULT_OPSET, graph=args.graph, precisions=precisions
        )
    except ExportError as exc:
        raise CliError(f"cannot export: {exc}") from exc
    except OSError as exc:  # the disk full, a quota, a read-only mount: said with where, and not a usage error
        raise CliError(f"cannot write the model to {out}: {exc.strerror or exc}", 1) from exc
    except ParityError as exc:
        sys.stdout.write(exc.report.table() + "\n")
        log.error("refusing to write %s: the exported model fails parity", args.out)
        return 1
    sys.stdout.write(report.table() + "\n")
    return 0


def _check_export_fits(config: MHAConfig) -> None:
    """Refuse, before any work, a model whose parity check (export's, verify's) cannot fit in this machine's
    (or container's) memory: a torch allocation error, or the kernel killing the process, says
    neither why nor what to change."""
    from export.grid import parity_peak_bytes
    from service.resources import memory_limit_bytes

    need, allowed = parity_peak_bytes(config), memory_limit_bytes()
    if need > allowed:
        raise CliError(
            f"--d-model {config.d_model} with --max-seq-len {config.max_seq_len}: checking the model against the "
            f"float64 references needs about {need / 2**30:,.1f} GiB (the attention scores of B = 7 rows of "
            f"T = max_seq_len, and the weights); this machine allows {allowed / 2**30:.1f} GiB. Give a smaller "
            "--max-seq-len or --d-model, or export and verify on a larger machine",
            2,
        )


def _precisions(text: str) -> tuple[str, ...]:
    from export.layout import PRECISIONS

    precisions = tuple(dict.fromkeys(p.strip() for p in text.split(",")))
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or "fp32" not in precisions:
        raise CliError(f"--precision {text!r}: expected fp32 plus any of fp16, bf16, comma-separated", 2)
    return precisions


def _model_from_args(args: argparse.Namespace) -> tuple[MHAConfig, Weights]:
    from dataclasses import replace

    from model import MHAConfig

    if args.checkpoint:
        from model.checkpoint import load_any

        given = [flag for flag, value in _NEW_MODEL_FLAGS.items() if value(args)]
        if given:
            raise ValueError(
                f"{', '.join(given)} {'says' if len(given) == 1 else 'say'} how to make new weights; with "
                "--checkpoint the weights and their width come from the file: drop them"
            )
        config, weights = load_any(
            args.checkpoint, n_head=args.n_head, max_seq_len=args.max_seq_len, prefix=args.import_prefix
        )
        if args.no_causal:
            config = replace(config, causal=False)
        _check_export_fits(config)
        return config, weights
    defaults = MHAConfig()
    config = MHAConfig(  # a value given, 0 included, is checked as given: MHAConfig says what is wrong
        d_model=defaults.d_model if args.d_model is None else args.d_model,
        n_head=defaults.n_head if args.n_head is None else args.n_head,
        max_seq_len=defaults.max_seq_len if args.max_seq_len is None else args.max_seq_len,
        causal=not args.no_causal,
        bias=not args.no_bias,
    )
    _check_export_fits(config)  # before the weights are made: --d-model 10**6 would ask for 16 TB
    from model.checkpoint import init_weights

    return config, init_weights(config, seed=0 if args.seed is None else args.seed)


_NEW_MODEL_FLAGS = {  # flags of `mha export` that only a model made from scratch uses
    "--d-model": lambda a: a.d_model is not None,
    "--no-bias": lambda a: a.no_bias,
    "--seed": lambda a: a.seed is not None,
}


class CliError(Exception):
    """A command cannot do what was asked; the message says why. Exit code 2: the command line
    is wrong (usage); 1: it is right but the work failed."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def cmd_verify(args: argparse.Namespace) -> int:
    """What the arguments get wrong is said before torch loads (seconds)."""
    model_dir = Path(args.model_dir)
    if args.http_url and not args.url:
        raise CliError("--http-url checks a running server's HTTP routes beside its gRPC ones: give --url too", 2)
    if (args.model != "mha" or args.model_version) and not args.url:
        raise CliError("--model and --model-version name what a running server serves: give --url too", 2)
    written = _writable("--json", args.json)
    if (problem := model_dir_problem(model_dir, flag="", serve=False)) is not None:
        raise CliError(problem, 2)  # a wrong path is not a model that failed its check, nor a server that did
    return _verified(args, model_dir, written)


def _verified(args: argparse.Namespace, model_dir: Path, written: Path | None) -> int:
    import json

    from export.layout import ModelFiles
    from export.verify import verify_model_dir
    from model.checkpoint import CheckpointError, stored_config
    from service.client.client import InferenceError
    from service.client.parity import verify_server

    report: RoutesReport | ParityReport
    if args.url:
        url = grpc_address(args.url)  # an http:// URL is the REST port, named as --http-url
        try:
            security = _client_security(args)
            http = _http_access(args, security.get("token"))
            served = {"model": args.model, "version": args.model_version}
            report = verify_server(url, model_dir, http=http, **served, **security)
        except InferenceError as exc:
            raise CliError(_with_port_hint(f"cannot verify the server at {url}: {exc}", url)) from exc
        except CheckpointError as exc:  # the answers are checked against these weights: without them, nothing
            raise CliError(f"{model_dir}: {exc}; give the model directory the server serves", 2) from exc
    else:
        if (config := stored_config(ModelFiles(model_dir).weights)) is not None:
            _check_export_fits(config)  # the grid at T = max_seq_len, on a machine smaller than the exporter's
        report = verify_model_dir(model_dir)
    sys.stdout.write(report.table() + "\n")
    if written is not None:
        written.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return 0 if report.ok else 1


def _client_security(args: argparse.Namespace) -> dict[str, Any]:
    """Client options for TLS, mTLS and bearer tokens, from --tls-ca, --tls-client-* and --token-file."""
    from service.protocol.auth import read_tokens

    options: dict[str, Any] = {}
    if args.token_file:  # its first token, where it holds several (a server's, while one is rotated)
        try:
            options["token"] = read_tokens(Path(args.token_file))[0]
        except ValueError as exc:
            raise CliError(f"--token-file {exc}", 2) from None
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise CliError("--tls-client-cert and --tls-client-key go together (mTLS); give both or neither", 2)
    if (args.tls_client_cert or args.tls_server_name) and not args.tls_ca:
        raise CliError("--tls-client-cert and --tls-server-name are for TLS: give --tls-ca too", 2)
    if args.tls_ca:
        options["root_certificates"] = _pem("--tls-ca", args.tls_ca)
    if args.tls_client_cert:
        options["client_cert"] = (
            _pem("--tls-client-key", args.tls_client_key),
            _pem("--tls-client-cert", args.tls_client_cert),
        )
    if args.tls_server_name:  # the name the certificate carries, where --url does not say it (a port-forward)
        options["server_name"] = args.tls_server_name
    return options


def _http_access(args: argparse.Namespace, token: str | None) -> HttpAccess | None:
    """How `mha verify` reaches the HTTP port (--http-url), with the client options of gRPC's."""
    import ssl

    from service.client.parity import HttpAccess

    if not args.http_url:
        return None
    if not args.http_url.startswith(("http://", "https://")):
        raise CliError(f"--http-url {args.http_url[:100]!r}: expected http://HOST:PORT or https://HOST:PORT", 2)
    if args.http_url.startswith("https://") and not args.tls_ca:
        raise CliError("--http-url https://... needs --tls-ca, the CA that signed the server's certificate", 2)
    access = HttpAccess(
        url=args.http_url,
        token=token,
        ca=Path(args.tls_ca) if args.tls_ca else None,
        client_cert=(Path(args.tls_client_cert), Path(args.tls_client_key)) if args.tls_client_cert else None,
        server_name=args.tls_server_name,
    )
    try:
        access.context()  # the CA and the client's pair read now: a file that is not one is a usage error
    except (ssl.SSLError, OSError) as exc:
        raise CliError(f"--tls-ca, --tls-client-cert or --tls-client-key for --http-url: {exc}", 2) from exc
    return access


def _pem(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"{flag} {path}: {exc.strerror}", 2) from exc


def model_dir_problem(model_dir: Path | None, flag: str = "--model-dir ", serve: bool = True) -> str | None:
    """What is wrong with a model directory (`flag`, then the path, names it) before anything
    binds or loads, said with the fix; None if nothing is (or it is unset: the default model)."""
    if model_dir is None:
        return None
    fix = f"export one with `mha export --out {model_dir}`"
    fix += ", or leave --model-dir unset to serve the default model" if serve else ""
    if not model_dir.exists():
        return f"{flag}{model_dir}: no such directory; {fix}"
    if not model_dir.is_dir():
        return f"{flag}{model_dir} is a file, not a directory: name the directory `mha export --out` wrote"
    from export.layout import ModelFiles

    weights = ModelFiles(model_dir).weights
    if not weights.is_file():
        return f"{flag}{model_dir} holds no exported model (no {weights.name}); {fix}"
    return None


def repository_problem(repository: Path | None) -> str | None:
    """What is wrong with --model-repository before anything binds; None if nothing is (or unset)."""
    if repository is None or repository.is_dir():
        return None
    what = "no such directory" if not repository.exists() else "a file, not a directory"
    return f"--model-repository {repository}: {what}; lay versions out as DIR/<model-name>/<version>/ (`mha export`)"


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--tls-ca", help="PEM CA bundle to trust the server's certificate (enables TLS)")
    p.add_argument("--tls-client-cert", help="PEM client certificate for mTLS")
    p.add_argument("--tls-client-key", help="PEM key of --tls-client-cert")
    p.add_argument(
        "--tls-server-name",
        help="the name to check the server's certificate for, when --url is another (a port-forward)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    from dataclasses import replace

    from service.logs import configure_logging
    from service.settings import settings_from_namespace

    configure_logging(args.log_level, args.log_format)  # first: off a terminal every line is JSON, errors too
    try:
        settings = settings_from_namespace(args, args.log_level)
    except ValueError as exc:
        log.error("invalid settings: %s", exc)
        return 2
    if settings.parent_pid is not None and not _tied_to(settings.parent_pid):
        return 1
    if settings.worker_peers > 1:  # several workers write one log: each line says whose it is
        configure_logging(args.log_level, args.log_format, worker=settings.worker_index)
    if not settings.thread_spinning:  # read once, when PyTorch loads its OpenMP runtime: before the import
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from service.app.preflight import StartupError, check_before_start, check_shared_ports
    from service.app.supervisor import Supervisor, gpu_devices, with_shared_ports, workers_to_start
    from service.resources import memory_limit_bytes
    from service.settings import default_model_home, to_argv

    if (problem := model_dir_problem(settings.model_dir) or repository_problem(settings.model_repository)) is not None:
        log.error("cannot start: %s", problem)
        return 2
    single = settings.model_repository is None  # one model directory: --model-dir, or the default model
    if single and settings.model_dir is None and settings.default_model_dir is None:
        settings = replace(settings, default_model_dir=default_model_home(Path.cwd(), os.environ))
    gpus = gpu_devices() if settings.workers == "auto" else []
    try:
        count = workers_to_start(settings, gpus)
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 2
    try:  # before the default model's export or any load, which take a while; once: a worker's supervisor did
        if settings.worker_peers <= 1:
            check_before_start(settings, os.environ, memory_limit_bytes())
        if count > 1:
            check_shared_ports(settings)
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return exc.exit_code
    if count > 1:
        with with_shared_ports(settings) as settings:
            argv = to_argv(replace(settings, workers="1", parent_pid=None))  # each worker's parent: the supervisor
            default_model = single and settings.model_dir is None  # the first worker binds, exports, loads
            try:
                supervisor = Supervisor(settings, argv, count, gpus, bind_first=default_model)
            except StartupError as exc:
                log.error("cannot start: %s", exc)
                return exc.exit_code
            return asyncio.run(supervisor.run())
    from service.app.server import serve  # ONNX Runtime and PyTorch: only where the model is served

    try:
        return asyncio.run(serve(settings))
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return exc.exit_code


def _tied_to(parent: int) -> bool:
    """This process ends when `parent` does; False (said) when `parent` did not start it, or has ended."""
    from service.app.launch import die_with_parent

    if die_with_parent(parent):
        return True
    log.error("cannot start: --parent-pid %d is not the process that started this one (ended already?)", parent)
    return False


def cmd_infer(args: argparse.Namespace) -> int:
    import time

    import numpy as np

    from service.client.client import InferenceError, MHAClient
    from service.protocol.grpc_codec import REAL_KINDS

    if args.address:
        raise CliError(f"unexpected argument {args.address!r}: give the server as --url {args.address}", 2)
    url = grpc_address(args.url)
    _positive(args.timeout, "--timeout")
    output = _writable("--output", args.output, suffix=".npy")
    if args.input:
        try:
            x = np.load(args.input)
        except (OSError, ValueError, EOFError) as exc:  # EOFError: an empty file
            said = str(exc) or type(exc).__name__
            raise CliError(f"--input {args.input}: {said}; expected a .npy file holding a (B, T, C) array", 2) from exc
        if x.dtype.kind not in REAL_KINDS:  # a complex array's cast would drop its imaginary parts
            raise CliError(f"--input {args.input} holds {x.dtype}; expected real numbers, a (B, T, C) array", 2)
        _fits_one_message(x.shape, f"--input {args.input}")
        x = x.astype(np.float32)
    else:
        try:
            shape = [int(v) for v in args.shape.split(",")]
            _fits_one_message(shape, f"--shape {args.shape}")
            x = random_input(shape, seed=args.seed)
        except (ValueError, MemoryError) as exc:  # not numbers, a negative one, or more than memory holds
            raise CliError(f"--shape {args.shape!r}: expected B,T,C such as 1,64,128 ({exc})", 2) from exc
    named = f" (request id {args.id[:64]!r})" if args.id else ""  # to find the call in the server's log
    with MHAClient(url, model=args.model, **_client_security(args)) as client:
        start = time.perf_counter()
        try:
            y, backend = client.infer_with_backend(x, timeout=args.timeout, request_id=args.id)
        except InferenceError as exc:
            raise CliError(_with_port_hint(str(exc), url) + named) from exc
        elapsed = time.perf_counter() - start
    sys.stdout.write(
        f"input {list(x.shape)} -> output {list(y.shape)} in {elapsed * 1e3:.2f} ms by {backend}{named}; "
        f"checksum sum={float(y.sum(dtype=np.float64)):.6f} mean|y|={float(np.abs(y).mean()):.6f}\n"
    )
    if output is not None:
        np.save(output, y)
        sys.stdout.write(f"wrote the output to {output}\n")
    return 0


def _fits_one_message(shape: Sequence[int], given: str) -> None:
    """Refuse, before an array is built or sent, a request larger than the client's gRPC message
    limit: B = 100,000,000 took a minute and 13 GB of memory to build, then could not be sent."""
    import math

    from service.client.client import MAX_MESSAGE_MB

    if min(shape, default=0) > 0 and (size := math.prod(shape) * 4) > MAX_MESSAGE_MB * 2**20:
        raise CliError(
            f"{given}: {size / 2**20:,.0f} MiB of float32, over the {MAX_MESSAGE_MB} MiB one request may carry "
            "(gRPC's message limit, the server's default --max-message-mb): send fewer rows",
            2,
        )


GRPC_URL_HELP = "the server's gRPC HOST:PORT, not its HTTP port (default 127.0.0.1:8001)"


def grpc_address(url: str) -> str:
    """--url as gRPC's HOST:PORT; an http(s):// URL is the REST endpoint, which these commands do not speak."""
    if "://" in url:
        raise CliError(
            f"--url {url!r}: expected the gRPC HOST:PORT such as 127.0.0.1:8001, not a URL; the HTTP/REST "
            "endpoint (port 8000) is for curl and tritonclient.http (docs/api.md)",
            2,
        )
    return url


def _with_port_hint(message: str, url: str) -> str:
    """gRPC's words for a gRPC client at an HTTP/1.1 port, followed by what to do."""
    if "HTTP/2" in message or "http2" in message.lower():
        return f"{message}\n{url} answers HTTP/1.1: is it the HTTP port? --url takes the gRPC port (default 8001)"
    return message


def _writable(flag: str, path: str | None, suffix: str = "") -> Path | None:
    """The file a command will write, checked before any work is done: a bad path fails at once,
    not after a whole run. np.save adds `suffix` when the name lacks it."""
    if path is None:
        return None
    given = target = Path(path)
    if suffix and target.suffix != suffix:
        target = target.with_name(target.name + suffix)
    if given.is_dir() or target.is_dir():
        raise CliError(f"{flag} {path} is a directory: name a file to write", 2)
    parent = target.parent
    if not parent.is_dir():
        raise CliError(f"{flag} {path}: there is no directory {parent}; create it first", 2)
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CliError(f"{flag} {path}: not writable by this user", 2)
    return target


def random_input(shape: Sequence[int], seed: int = 0) -> np.ndarray:
    """Seeded standard-normal float32, the same on every machine."""
    import numpy as np

    return np.random.default_rng(seed).standard_normal(tuple(shape), dtype=np.float32)


def cmd_bench(args: argparse.Namespace) -> int:
    """Closed-loop load at each concurrency in turn: a table on the terminal, JSON/CSV on request."""
    from dataclasses import replace

    from service.client.loadgen import CONNECTIONS, run_load, server_cpu_seconds

    levels, seqs = _clients(args.concurrency), _int_list(args.seq_lens, "--seq-lens")
    _positive(args.seconds, "--seconds")
    if args.batch < 1:
        raise CliError(f"--batch {args.batch}: expected B >= 1 rows per request", 2)
    args.url = grpc_address(args.url)
    for flag in ("json", "csv", "plot"):  # every output checked before the run, not after it
        _writable(f"--{flag}", getattr(args, flag))
    if args.plot:
        _plotter()
    security = _client_security(args)
    d_model = _served_width(args.url, security, args, seqs)
    metrics_url = None if args.metrics_url == "off" else args.metrics_url or f"{args.url.rsplit(':', 1)[0]}:8002"
    if metrics_url is not None and server_cpu_seconds(metrics_url) is None:
        log.warning(
            "server CPU per request not measured: http://%s/metrics did not answer (give --metrics-url, or off)",
            metrics_url,
        )
        metrics_url = None
    modes = CONNECTIONS if args.connections == "both" else (args.connections,)
    runs = [(clients, mode) for clients in levels for mode in modes]
    results = []
    for n, (clients, mode) in enumerate(runs, 1):
        progress = _progress_bar(f"[{n}/{len(runs)}] {clients:>4} clients, {mode:<11}", args.seconds)
        cpu_before = server_cpu_seconds(metrics_url) if metrics_url else None
        own = mode == "per-client"
        result = run_load(
            args.url,
            clients,
            args.seconds,
            seqs,
            batch=args.batch,
            d_model=d_model,
            progress=progress,
            own_connection=own,
            **security,
        )
        progress(args.seconds, result.requests, done=True)
        cpu_after = server_cpu_seconds(metrics_url) if metrics_url else None
        if cpu_before is not None and cpu_after is not None and result.requests:
            result = replace(result, server_cpu_ms_per_request=(cpu_after - cpu_before) / result.requests * 1e3)
        results.append(result)
        if result.stopped:
            raise CliError(f"stopped: the server refused the requests: {result.stopped}")
    _write_results(results, args)
    return 0 if all(r.requests for r in results) else 1


def _progress_bar(label: str, seconds: float) -> Any:
    """A progress line on stderr, redrawn in place on a terminal (one line per level otherwise)."""
    terminal = sys.stderr.isatty()

    def show(elapsed: float, requests: int, done: bool = False) -> None:
        if not terminal and not done:
            return
        filled = int(24 * min(1.0, elapsed / seconds)) if seconds else 24
        bar = "#" * filled + "." * (24 - filled)
        line = f"{label} [{bar}] {min(elapsed, seconds):5.1f}/{seconds:g} s {requests:>8} req"
        sys.stderr.write(("\r" if terminal else "") + line + ("\n" if done else ""))
        sys.stderr.flush()

    return show


def _positive(value: float, flag: str) -> None:
    """A duration: a positive, finite number (nan and inf parse as floats, and pass `> 0` or `<= 0`)."""
    if not 0 < value < float("inf"):
        raise CliError(f"{flag} {value:g}: expected a positive, finite number of seconds", 2)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError as exc:
        raise CliError(f"{flag} {text!r}: expected integers separated by commas, such as 1,8,32", 2) from exc
    if not values or min(values) < 1:
        raise CliError(f"{flag} {text!r}: expected positive integers", 2)
    return values


MAX_CLIENTS = 1024  # each a thread of the load generator, and with a connection each, a file descriptor


def _clients(text: str) -> list[int]:
    """--concurrency: before, 100,000 clients started a thread each until the machine could start no more."""
    levels = _int_list(text, "--concurrency")
    if max(levels) > MAX_CLIENTS:
        raise CliError(
            f"--concurrency {text[:40]}: at most {MAX_CLIENTS} clients, each a thread of this process (and a "
            "connection of its own); for more, run several processes",
            2,
        )
    return levels


def _served_width(url: str, security: dict[str, Any], args: argparse.Namespace, seqs: list[int]) -> int:
    """C, from the server's own model config (or --d-model), and the load checked against what the
    server takes before any request is made: B = 100000 took minutes to build, then was refused."""
    from service.client.client import InferenceError, MHAClient

    try:
        with MHAClient(url, **security) as client:
            config = client.model_config()
        params = config.parameters
        width, longest = int(params["d_model"].string_value), int(params["max_seq_len"].string_value)
    except (InferenceError, ValueError) as exc:
        if isinstance(exc, InferenceError) and exc.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            fix = "start one (`mha serve`), or give its --url"
            raise CliError(f"no gRPC server answers at {url}: {exc}; {fix}") from exc
        if args.d_model:
            return int(args.d_model)  # another server, or an older one: its refusals will say
        raise CliError(f"cannot read the model's width from {url}: {exc}; pass --d-model") from exc
    rows = config.max_batch_size
    if rows and args.batch > rows:
        raise CliError(f"--batch {args.batch}: the server at {url} takes at most {rows} rows a request", 2)
    if max(seqs) > longest:
        raise CliError(f"--seq-lens {args.seq_lens}: the server at {url} takes T up to {longest}", 2)
    return int(args.d_model or width)


def _write_results(results: list[Any], args: argparse.Namespace) -> None:
    import csv
    import json

    columns = ["concurrency", "connections", "requests", "throughput_rps", "p50_ms", "p90_ms", "p95_ms", "p99_ms"]
    columns.append("server_cpu_ms_per_request")
    lines = [" ".join(f"{TABLE_HEADINGS[c]:>14}" for c in columns)]
    for r in results:
        row = r.to_dict()
        lines.append(" ".join(f"{_cell(row[c]):>14}" for c in columns))
    sys.stdout.write("\n".join(lines) + "\n")
    written = []
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in results], indent=1) + "\n")
        written.append(args.json)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(r.to_dict() for r in results)
        written.append(args.csv)
    if args.plot:
        _plotter()(results, Path(args.plot), f"mha bench {args.url}: B={args.batch}, T in {{{args.seq_lens}}}")
        written.append(args.plot)
    if written:
        sys.stdout.write(f"wrote {', '.join(written)}\n")


def _cell(value: object) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


TABLE_HEADINGS = {
    "concurrency": "clients",
    "connections": "connections",
    "requests": "requests",
    "throughput_rps": "req/s",
    "p50_ms": "p50 ms",
    "p90_ms": "p90 ms",
    "p95_ms": "p95 ms",
    "p99_ms": "p99 ms",
    "server_cpu_ms_per_request": "server CPU ms/req",
}


def _plotter() -> Any:
    """benchplot.plot_sweep, or the one line that says how to get matplotlib."""
    try:
        import matplotlib  # noqa: F401  (checked before a run, not after it)

        from service.client.benchplot import plot_sweep
    except ImportError as exc:  # pragma: no cover - the dev install has matplotlib
        raise CliError(f"--plot needs matplotlib: pip install 'mha-serve[plot]' ({exc})", 2) from exc
    return plot_sweep


class OneLineParser(argparse.ArgumentParser):
    """A command-line mistake answers one line (what was wrong, and where the options are), not
    the whole usage, which for `mha serve` is 35 lines long."""

    log_format = "text"  # `mha serve`'s: auto, json or text, as its logs will be

    def error(self, message: str) -> NoReturn:
        text = f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)"
        fmt = _given_log_format(sys.argv) or self.log_format
        if fmt == "json" or (fmt == "auto" and not sys.stderr.isatty()):
            text = json_log_line("ERROR", text)  # off a terminal the server's every line is JSON
        self.exit(2, text + "\n")


def _given_log_format(argv: Sequence[str]) -> str | None:
    """--log-format as written on a command line that did not parse."""
    for i, arg in enumerate(argv):
        if arg == "--log-format" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--log-format="):
            return arg.split("=", 1)[1]
    return None


def json_log_line(level: str, message: str) -> str:
    """One line as service.logs writes it, for what is said before logging is set up."""
    from service.logs import JsonFormatter

    record = logging.LogRecord("mha", getattr(logging, level), "", 0, message, None, None)
    return JsonFormatter().format(record)


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    from service.settings import LOG_LEVELS, add_serve_arguments

    parser = OneLineParser(prog="mha", description="Serve a causal multi-head attention block over gRPC.")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=environ.get("MHA_LOG_LEVEL", "INFO"),
        help="log level (default INFO) [env MHA_LOG_LEVEL]",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    p = sub.add_parser("export", help="export the model to a verified ONNX model directory")
    p.add_argument("--out", required=True, help="model directory to write (new or empty, unless --force)")
    p.add_argument("--force", action="store_true", help="replace the files of an existing model directory")
    p.add_argument("--checkpoint", help="our safetensors, GPT-2 safetensors (c_attn) or nanoGPT .pt")
    p.add_argument("--import-prefix", help="with several layers in --checkpoint: which, e.g. 'h.0.attn.'")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 23)")
    p.add_argument(
        "--precision", default="fp32", help="graphs to write: fp32 (model.onnx) plus fp16, bf16 (default fp32)"
    )
    p.add_argument(
        "--graph",
        choices=("attention", "plain"),
        default="attention",
        help="attention: one ONNX Attention op (default, fastest on ORT); plain: MatMul/Softmax",
    )
    _add_model_args(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify", help="parity of a model directory (or of a running server with --url)")
    p.add_argument("model_dir", help="model directory written by `mha export`")
    p.add_argument("--url", help="HOST:PORT of a running server's gRPC port: check its routes end to end")
    p.add_argument("--http-url", help="http(s)://HOST:PORT of the same server's HTTP port: check its routes too")
    p.add_argument("--json", help="write the results as JSON to this file too (checked writable first)")
    p.add_argument("--model", default="mha", help="with --url: the model's name on the server (default mha)")
    p.add_argument("--model-version", default="", help="with --url: its version (default: the one served by default)")
    _add_client_args(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "serve",
        help="serve the model over gRPC (Open Inference Protocol)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.log_format = environ.get("MHA_LOG_FORMAT", "auto")  # type: ignore[attr-defined]
    add_serve_arguments(p, environ)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("infer", help="send one tensor to a running server")
    p.add_argument("address", nargs="?", help=argparse.SUPPRESS)  # `mha infer HOST:PORT`: said what to write
    p.add_argument("--url", default="127.0.0.1:8001", help=GRPC_URL_HELP)
    p.add_argument("--shape", default="1,64,128", help="B,T,C of a random input (default 1,64,128)")
    p.add_argument("--input", help=".npy file with a (B, T, C) array, instead of --shape")
    p.add_argument("--output", help="write the output to this .npy file (checked writable before sending)")
    p.add_argument("--model", default="mha", help="model name (default mha)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--id", default="", help="the request's id, which the server logs it under (default: one it makes)")
    _add_client_args(p)
    p.set_defaults(func=cmd_infer)

    p = sub.add_parser("bench", help="closed-loop load on a running server: req/s, latency percentiles, CPU")
    p.add_argument("--url", default="127.0.0.1:8001", help=GRPC_URL_HELP)
    p.add_argument("--concurrency", default="1,8,32", help="clients per level, comma-separated (default 1,8,32)")
    p.add_argument(
        "--connections",
        choices=("both", "one-channel", "per-client"),
        default="both",
        help="one-channel: the clients share one gRPC channel, as the threads of most applications do; per-client: "
        "a connection each, as separate processes; both (default): each level both ways, side by side",
    )
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each level (default 10)")
    p.add_argument("--batch", type=int, default=1, help="B per request (default 1)")
    p.add_argument("--seq-lens", default="64", help="T values drawn at random, comma-separated (default 64)")
    p.add_argument("--d-model", type=int, default=None, help="C (default: the server's)")
    p.add_argument("--metrics-url", help="HOST:PORT of the server's /metrics for CPU per request (default :8002; off)")
    p.add_argument("--json", help="write the results as JSON to this file")
    p.add_argument("--csv", help="write the results as CSV to this file")
    p.add_argument("--plot", help="write a PNG of latency and throughput against concurrency (needs matplotlib)")
    _add_client_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tune", help="the settings that meet a p99 target with the most req/s, measured here")
    p.add_argument("--model-dir", required=True, help="model directory to serve (`mha export --out`)")
    p.add_argument(
        "--shape", action="append", required=True, help="B,T,C of the requests to expect (repeat, or B,T,C,B,T,C)"
    )
    p.add_argument("--p99-ms", type=float, required=True, help="the p99 latency target, in ms")
    p.add_argument("--concurrency", default="1,8", help="clients per load point, comma-separated (default 1,8)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per load point and mode (default 3)")
    p.add_argument("--budget-s", type=float, default=240.0, help="time for the whole search (default 240 s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds beside the defaults (default 3)")
    p.add_argument("--out", default="tune", help="folder for config.env, the tables and the plot (default ./tune)")
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC port of the candidates (default: a free one)")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("pod-cost", help="sidecar: the pod's deletion cost kept at the server's live sequences")
    p.add_argument("--metrics-url", default="127.0.0.1:8002", help="HOST:PORT of the server's /metrics")
    p.add_argument("--pod", default=None, help="this pod's name (default: MHA_POD_NAME, else the host name)")
    p.add_argument("--interval-s", type=float, default=5.0, help="seconds between looks (default 5)")
    p.set_defaults(func=cmd_pod_cost)
    return parser


def cmd_tune(args: argparse.Namespace) -> int:
    """Search the serving settings on this machine; write config.env, the tables and the plot."""
    from dataclasses import replace

    from service.app.tune import Request, TuneError, parse_shapes, tune

    try:
        concurrency = _clients(args.concurrency)
        shapes = parse_shapes(args.shape)
        request = Request(Path(args.model_dir), shapes, args.p99_ms, concurrency, args.seconds, args.budget_s)
        return tune(replace(request, rounds=args.rounds, out=Path(args.out), grpc_port=args.grpc_port))
    except TuneError as exc:
        raise CliError(str(exc), exc.code) from exc


def cmd_pod_cost(args: argparse.Namespace) -> int:
    """Until SIGTERM: the pod's controller.kubernetes.io/pod-deletion-cost at its live sequences."""
    import signal
    import threading
    from functools import partial

    from service.client.podcost import CostKeeper, PodApi, pod_name, read_metrics

    _positive(args.interval_s, "--interval-s")
    try:
        api = PodApi.in_cluster(args.pod or pod_name(os.environ), os.environ)
    except (KeyError, OSError) as exc:
        raise CliError(f"not in a Kubernetes pod with a service account token ({exc}); see docs/operations.md") from exc
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    CostKeeper(partial(read_metrics, args.metrics_url), api.patch_cost, args.interval_s).run(stop)
    return 0


# ONNX Runtime (1.29 and later) sends usage events to its maker and keeps a device id and an event
# database in ~/.cache, unless this is 1; on a read-only HOME it writes a line of its own to stderr.
# Off unless the operator sets it to 0 (docs/operations.md, "ONNX Runtime's telemetry").
ORT_TELEMETRY = "ORT_DISABLE_TELEMETRY"


def main(argv: Sequence[str] | None = None) -> int:
    from service.app.triton_flags import translated
    from service.settings import LOG_LEVELS

    parser = build_parser(os.environ)
    args = parser.parse_args(translated(sys.argv[1:] if argv is None else argv, parser.error))
    if args.log_level not in LOG_LEVELS:  # MHA_LOG_LEVEL's: argparse checks no default against the choices
        parser.error(f"MHA_LOG_LEVEL {args.log_level[:40]!r}: expected one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    for noisy in ("onnx_ir", "onnxscript"):  # the exporter's optimiser narrates every node at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault(ORT_TELEMETRY, "1")  # before ONNX Runtime loads, which reads it once
    try:
        return int(args.func(args))
    except CliError as exc:
        log.error("%s", exc)
        return exc.exit_code
    except OSError as exc:  # a file named on the command line: missing, unreadable
        log.error("%s: %s", exc.filename or "", exc.strerror or exc)
        return 2
    finally:  # the process ends next: its objects go with it, not one by one through the collector
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
