"""TLS, mTLS and bearer tokens end to end, with certificates made here."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.app.server import ready_line
from service.client.client import InferenceError, MHAClient
from service.client.parity import ROUTE_WIDTH
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.protocol.auth import CONTROL_CALLS, Access, TokenFiles
from service.protocol.tls import TlsFiles
from service.settings import Settings
from tests.e2e.test_perf_analyzer import LIBRARIES, PERF_ANALYZER, SHORT
from tests.e2e.test_serve_process import TRITON_PYTHON
from tests.support import ROOT, ManualClock, ServerThread, make_settings

X = np.ones((1, 4, 32), np.float32)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    ca: bool = False,
    server: bool = False,
    days: int = 1,
    dns: tuple[str, ...] = (),  # the names it carries instead of localhost and 127.0.0.1
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server or dns:
        names = [x509.DNSName(n) for n in dns] or [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


def _pair(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
    (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{stem}.key").write_bytes(_pem_key(key))
    return directory / f"{stem}.crt", directory / f"{stem}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("mha-test-ca", ca_key, None, ca=True)
    other_ca = _cert("someone-else", other_key, None, ca=True)
    server_key, client_key, rogue_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    paths = {}
    paths["ca"], _ = _pair(d, "ca", ca, ca_key)
    paths["server_crt"], paths["server_key"] = _pair(
        d, "server", _cert("localhost", server_key, (ca, ca_key), server=True), server_key
    )
    paths["client_crt"], paths["client_key"] = _pair(d, "client", _cert("client", client_key, (ca, ca_key)), client_key)
    paths["rogue_crt"], paths["rogue_key"] = _pair(
        d, "rogue", _cert("rogue", rogue_key, (other_ca, other_key)), rogue_key
    )
    paths["other_ca"], _ = _pair(d, "other_ca", other_ca, other_key)  # the CA a rotation moves to
    svc_key = ec.generate_private_key(ec.SECP256R1())  # a Service's name alone, as cert-manager would issue it
    paths["svc_crt"], paths["svc_key"] = _pair(
        d, "svc", _cert("svc", svc_key, (ca, ca_key), dns=("mha-serve.serving.svc",)), svc_key
    )
    next_key = ec.generate_private_key(ec.SECP256R1())
    paths["next_crt"], paths["next_key"] = _pair(
        d, "next", _cert("localhost", next_key, (other_ca, other_key), server=True, days=90), next_key
    )
    return paths


def _over_tls(model_dir: Path, cert: Path, key: Path, **extra: object) -> Settings:
    """A server's settings serving TLS with `cert` and `key`."""
    return make_settings(model_dir, tls_cert=cert, tls_key=key, backend="torch", **extra)


def _tls_client(url: str, pki: dict[str, Path], who: str | None = None, ca: str = "ca", **kw: object) -> MHAClient:
    cert = (pki[f"{who}_key"].read_bytes(), pki[f"{who}_crt"].read_bytes()) if who else None
    return MHAClient(url, root_certificates=pki[ca].read_bytes(), client_cert=cert, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tls_server(small_model_dir: Path, pki: dict[str, Path]) -> Iterator[ServerThread]:
    settings = _over_tls(small_model_dir, pki["server_crt"], pki["server_key"])
    with ServerThread(settings) as s:
        yield s


def test_tls(tls_server: ServerThread, pki: dict[str, Path]) -> None:
    with _tls_client(tls_server.url, pki) as client:
        assert client.infer(X).shape == X.shape
    assert f"--tls-ca <the CA that signed {pki['server_crt']}>`" in ready_line(tls_server.running)  # what to try
    with MHAClient(tls_server.url) as plaintext, pytest.raises(InferenceError) as info:
        plaintext.infer(X, timeout=5)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_mtls(small_model_dir: Path, pki: dict[str, Path]) -> None:
    settings = _over_tls(small_model_dir, pki["server_crt"], pki["server_key"], tls_client_ca=pki["ca"])
    with ServerThread(settings) as s:
        with _tls_client(s.url, pki, "client") as client:
            assert client.infer(X).shape == X.shape
        for who in (None, "rogue"):
            with _tls_client(s.url, pki, who) as client, pytest.raises(InferenceError) as info:
                client.infer(X, timeout=5)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_bearer_token(small_model_dir: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with ServerThread(make_settings(small_model_dir, auth_token_file=token_file, backend="torch")) as s:
        with MHAClient(s.url, token="s3cret-token") as client:
            assert client.infer(X).shape == X.shape
            assert len(list(client.stream_infer([X, X]))) == 2
        with MHAClient(s.url, model="mha_sequence", token="s3cret-token") as client:
            assert client.step("authorized", X, 0, start=True, end=True).y.shape == X.shape
        for token in (None, "wrong", "s3cret-token-but-longer"):
            with MHAClient(s.url, model="mha_sequence", token=token) as client, pytest.raises(InferenceError) as info:
                client.step("intruder", X, 0, start=True, timeout=5)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        for token in (None, "wrong", "s3cret-token-but-longer"):
            with MHAClient(s.url, token=token) as client, pytest.raises(InferenceError) as info:
                client.infer(X, timeout=5)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer <token>" in str(info.value)
        with MHAClient(s.url) as client, pytest.raises(InferenceError) as info:
            list(client.stream_infer([X]))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        # probes stay open without a token
        with grpc.insecure_channel(s.url) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            response = health.Check(health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_under_mtls_probes_use_the_plaintext_health_port(small_model_dir: Path, pki: dict[str, Path]) -> None:
    settings = _over_tls(small_model_dir, pki["server_crt"], pki["server_key"], tls_client_ca=pki["ca"], health_port=0)
    with ServerThread(settings) as s, grpc.insecure_channel(f"127.0.0.1:{s.health_port}") as channel:
        for service in ("", "inference.GRPCInferenceService"):
            request = health_pb2.HealthCheckRequest(service=service)
            assert (
                health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        with pytest.raises(grpc.RpcError) as info:  # nothing but health on that port
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with _tls_client(s.url, pki) as no_client_cert, pytest.raises(InferenceError):
            no_client_cert.infer(X, timeout=5)  # the main port still demands a client certificate


@pytest.mark.parametrize(
    ("files", "named"),
    [
        (("client_crt", "server_key"), "--tls-cert"),  # a key that does not match the certificate
        (("server_key", "server_key"), "--tls-cert"),  # not a certificate
        (("server_crt", "missing"), "--tls-key"),
    ],
    ids=["key-mismatch", "not-a-cert", "missing-key"],
)
def test_bad_tls_files_are_named_in_one_line(
    small_model_dir: Path, pki: dict[str, Path], tmp_path: Path, files: tuple[str, str], named: str
) -> None:
    cert, key = (pki.get(name, tmp_path / "missing.pem") for name in files)
    args = ["serve", "--model-dir", str(small_model_dir), "--host", "127.0.0.1", "--grpc-port", "0"]
    args += ["--metrics-port", "off", "--tls-cert", str(cert), "--tls-key", str(key), "--log-format", "text"]
    run = subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "cannot start: --tls-cert" in run.stderr and named in run.stderr
    assert "Traceback" not in run.stderr


def test_http_serves_tls_with_the_same_certificate(small_model_dir: Path, pki: dict[str, Path]) -> None:
    import ssl
    import urllib.error
    import urllib.request

    settings = _over_tls(small_model_dir, pki["server_crt"], pki["server_key"], http_port=0)
    with ServerThread(settings) as s:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        url = f"https://127.0.0.1:{s.http_port}/v2/health/ready"
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            assert response.status == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}/v2/health/ready", timeout=10)


USER, ADMIN = "user-token", "admin-token"


def _grpc_code(url: str, method: str, request: object, token: str | None) -> grpc.StatusCode:
    metadata = [] if token is None else [("authorization", f"Bearer {token}")]
    with grpc.insecure_channel(url) as channel:
        try:
            getattr(pb_grpc.GRPCInferenceServiceStub(channel), method)(request, metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _http(port: int, method: str, path: str, token: str | None, body: bytes = b"") -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    conn.request(method, path, body=body or None, headers=headers)
    response = conn.getresponse()
    answer = json.loads(response.read() or b"{}")
    conn.close()
    return response.status, answer


def _http_raw_authorization(port: int, value: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("GET", "/v2/logging")
    conn.putheader("Authorization", value)
    conn.endheaders()
    status = conn.getresponse().status
    conn.close()
    return status


CONTROLS = {  # a control call of each kind: (gRPC method, request), (HTTP method, path)
    "repository": (("RepositoryIndex", pb.RepositoryIndexRequest()), ("POST", "/v2/repository/index")),
    "log": (("LogSettings", pb.LogSettingsRequest()), ("GET", "/v2/logging")),
    "trace": (("TraceSetting", pb.TraceSettingRequest()), ("GET", "/v2/trace/setting")),
    "regions": (
        ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest()),
        ("GET", "/v2/systemsharedmemory/status"),
    ),
}


def test_control_calls_are_every_kind_of_rpc_that_changes_the_server() -> None:
    rpcs = set(pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name)
    assert CONTROL_CALLS <= rpcs, CONTROL_CALLS - rpcs
    assert {"ModelInfer", "ModelStreamInfer", "ModelMetadata", "ModelStatistics"}.isdisjoint(CONTROL_CALLS)
    kinds = ("Repository", "SystemSharedMemory", "CudaSharedMemory")
    assert {call for call in rpcs if call.startswith(kinds)} <= CONTROL_CALLS


def test_control_calls_need_the_admin_token(small_model_dir: Path, tmp_path: Path) -> None:
    """--admin-token-file: repository, log, trace and shared-memory calls need the admin token,
    on both protocols. The inference token is known, so with it they are PERMISSION_DENIED (403);
    without a token or with a wrong one, UNAUTHENTICATED (401). Inference takes either token."""
    (tmp_path / "user").write_text(USER + "\n")
    (tmp_path / "admin").write_text(ADMIN + "\n")
    files = {"auth_token_file": tmp_path / "user", "admin_token_file": tmp_path / "admin"}
    with ServerThread(make_settings(small_model_dir, http_port=0, shared_memory="system", **files)) as s:
        for (method, request), (verb, path) in CONTROLS.values():
            codes = [_grpc_code(s.url, method, request, token) for token in (None, "wrong", USER, ADMIN)]
            unknown, known = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
            assert codes == [unknown, unknown, known, grpc.StatusCode.OK], (method, codes)
            statuses = [_http(s.http_port, verb, path, token)[0] for token in (None, "wrong", USER, ADMIN)]
            assert statuses == [401, 401, 403, 200], (path, statuses)
        status, answer = _http(s.http_port, "POST", "/v2/repository/models/mha/unload", USER)
        assert status == 403 and "send the admin token" in str(answer["error"]), answer
        for garbage in (b"Bearer \xff\xfe", b"Bearer " + b"x" * 8000, "Bearer \u00fc".encode()):  # before: 500
            assert _http_raw_authorization(s.http_port, garbage) == 401, garbage[:16]
        for token in (USER, ADMIN):
            with MHAClient(s.url, token=token) as client:
                assert client.infer(X).shape == X.shape
        assert _grpc_code(s.url, "ServerReady", pb.ServerReadyRequest(), None) == grpc.StatusCode.UNAUTHENTICATED


def test_the_admin_token_alone_guards_only_the_control_calls(small_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "admin").write_text(ADMIN)
    with ServerThread(make_settings(small_model_dir, admin_token_file=tmp_path / "admin")) as s:
        with MHAClient(s.url) as client:
            assert client.infer(X).shape == X.shape
        assert _grpc_code(s.url, "LogSettings", pb.LogSettingsRequest(), None) == grpc.StatusCode.UNAUTHENTICATED
        assert _grpc_code(s.url, "LogSettings", pb.LogSettingsRequest(), ADMIN) == grpc.StatusCode.OK
        with grpc.insecure_channel(s.url) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
        assert refused.value.details() == (
            "missing or wrong credentials: send the admin token in metadata 'authorization: Bearer <token>'"
        )


def test_a_token_file_of_several_lines_accepts_each_so_a_token_rotates(small_model_dir: Path, tmp_path: Path) -> None:
    """One token a line: while a token is rotated, the file holds the new and the old, and clients
    of either are served; a token no line holds is refused. `mha infer --token-file` sends the
    first line's."""
    (tmp_path / "tokens").write_text("new-token\n\nold-token\n")
    with ServerThread(make_settings(small_model_dir, auth_token_file=tmp_path / "tokens")) as s:
        for token in ("new-token", "old-token"):
            with MHAClient(s.url, token=token) as client:
                assert client.infer(X).shape == X.shape
        for token in ("new-token old-token", "", "old"):
            with MHAClient(s.url, token=token) as client, pytest.raises(InferenceError) as info:
                client.infer(X, timeout=5)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        shape = ",".join(str(n) for n in X.shape)
        cli = [sys.executable, "-m", "service.cli", "infer", "--url", s.url, "--shape", shape]
        done = subprocess.run([*cli, "--token-file", str(tmp_path / "tokens")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def _taken(access: Access, token: str, method: str = "ModelInfer") -> bool:
    try:
        access.check(method, f"Bearer {token}", "a header")
    except Exception:
        return False
    return True


def test_token_files_changed_while_serving_are_taken_and_a_bad_change_is_not(tmp_path: Path) -> None:
    """A token is added or removed without a restart: the files are read again once they change,
    written in place or swapped in as a Kubernetes Secret's are. A change that cannot be read, or
    that puts a token in both files, leaves the tokens as they were."""
    token, admin = tmp_path / "token", tmp_path / "admin"
    token.write_text("old\n")
    admin.write_text("adm\n")
    files = TokenFiles(token, admin)
    access = files.access
    assert not files.reread() and _taken(access, "old") and not _taken(access, "new")
    token.write_text("new\nold\n")
    assert files.reread() and _taken(access, "new") and _taken(access, "old")
    for bad in ("", "adm\n"):  # empty; a token of the admin's file too
        token.write_text(bad)
        assert not files.reread() and _taken(access, "new") and _taken(access, "adm", "LogSettings")
        assert not _taken(access, "new", "LogSettings")  # the admin token stays the only one for control calls
    (swapped := tmp_path / "next").write_text("newest\n")
    os.replace(swapped, token)  # a Secret's update: a new file in the old one's place
    assert files.reread() and _taken(access, "newest") and not _taken(access, "new")
    admin.unlink()  # a file gone: kept as it was
    assert not files.reread() and _taken(access, "adm", "LogSettings")


def test_the_files_are_looked_at_on_the_servers_clock(small_model_dir: Path, tmp_path: Path) -> None:
    """While serving, the token file is looked at every 10 s of the server's clock: a token added
    to it is accepted after the next look, and not before."""
    (tmp_path / "token").write_text(USER)
    clock = ManualClock()
    with ServerThread(make_settings(small_model_dir, auth_token_file=tmp_path / "token"), clock=clock) as s:
        metadata = pb.ServerMetadataRequest()
        assert _grpc_code(s.url, "ServerMetadata", metadata, USER) == grpc.StatusCode.OK
        (tmp_path / "token").write_text(f"{USER}\nrotated\n")
        s.call(clock.advance_and_settle(9.0))
        assert _grpc_code(s.url, "ServerMetadata", metadata, "rotated") == grpc.StatusCode.UNAUTHENTICATED
        s.call(clock.advance_and_settle(1.5))
        assert _grpc_code(s.url, "ServerMetadata", metadata, "rotated") == grpc.StatusCode.OK
        assert _refused(s, "tokens") == 0
        (tmp_path / "token").write_text("")  # a change that cannot be taken: what on-call is told of
        s.call(clock.advance_and_settle(10.5))
        assert _refused(s, "tokens") == 1
        assert _grpc_code(s.url, "ServerMetadata", metadata, "rotated") == grpc.StatusCode.OK  # kept
        (tmp_path / "token").write_text("rotated\n")
        s.call(clock.advance_and_settle(10.5))
        assert _refused(s, "tokens") == 0


def _refused(server: ServerThread, files: str) -> float | None:
    return server.registry.get_sample_value("mha_watched_files_refused", {"files": files})


def _served(files: dict[str, Path], pki: dict[str, Path], cert: str, key: str, client_ca: str) -> None:
    """What the server's TLS files hold, each swapped in as a Secret's files are."""
    for name, source in (("tls.crt", cert), ("tls.key", key), ("ca.crt", client_ca)):
        (staged := files["dir"] / f"{name}.next").write_bytes(pki[source].read_bytes())
        os.replace(staged, files[name])


def _grpc_tls_code(url: str, pki: dict[str, Path], who: str, ca: str) -> grpc.StatusCode:
    with _tls_client(url, pki, who, ca) as client:
        try:
            client.infer(X, timeout=5)
        except InferenceError as exc:
            return exc.code
    return grpc.StatusCode.OK


def _https_status(port: int, pki: dict[str, Path], who: str, ca: str) -> int | str:
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=str(pki[ca]))
    context.load_cert_chain(pki[f"{who}_crt"], pki[f"{who}_key"])
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/v2/health/ready", context=context, timeout=10) as r:
            return int(r.status)
    except OSError as exc:  # urllib's URLError, or the connection closed on a refused certificate
        return type(exc).__name__


def test_a_renewed_certificate_is_served_without_a_restart(
    small_model_dir: Path, pki: dict[str, Path], tmp_path: Path
) -> None:
    """cert-manager renews a certificate by updating its Secret in place. After the next look at
    the files (every 10 s of the server's clock), new connections of both protocols get the new
    certificate and are checked against the new client CA; a connection already open keeps going."""
    files = {"dir": tmp_path, **{name: tmp_path / name for name in ("tls.crt", "tls.key", "ca.crt")}}
    _served(files, pki, "server_crt", "server_key", "ca")
    clock = ManualClock()
    settings = _over_tls(
        small_model_dir, files["tls.crt"], files["tls.key"], tls_client_ca=files["ca.crt"], http_port=0
    )
    with ServerThread(settings, clock=clock) as s, _tls_client(s.url, pki, "client") as open_before:
        assert open_before.infer(X).shape == X.shape
        assert _expires_in_days(s) == pytest.approx(1, abs=0.01)
        assert _https_status(s.http_port, pki, "client", "ca") == 200
        _served(files, pki, "next_crt", "next_key", "other_ca")
        s.call(clock.advance_and_settle(9.0))
        assert _grpc_tls_code(s.url, pki, "client", "ca") == grpc.StatusCode.OK  # not looked at yet
        s.call(clock.advance_and_settle(1.5))
        assert _grpc_tls_code(s.url, pki, "rogue", "other_ca") == grpc.StatusCode.OK  # the new CA's client
        assert _grpc_tls_code(s.url, pki, "client", "ca") == grpc.StatusCode.UNAVAILABLE
        assert _https_status(s.http_port, pki, "rogue", "other_ca") == 200
        assert _https_status(s.http_port, pki, "client", "ca") != 200
        assert open_before.infer(X).shape == X.shape
        assert _expires_in_days(s) == pytest.approx(90, abs=0.01)  # what an alert watches


def _expires_in_days(server: ServerThread) -> float:
    expires = server.registry.get_sample_value("mha_tls_certificate_expiry_timestamp_seconds")
    assert expires is not None
    return (expires - time.time()) / 86400


def test_tls_files_half_written_are_not_taken(pki: dict[str, Path], tmp_path: Path) -> None:
    """A certificate written before its key (two writes, not one swap) does not match the key
    served: nothing is taken until the pair matches again, and gRPC is offered each change once."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pki["server_crt"].read_bytes())
    key.write_bytes(pki["server_key"].read_bytes())
    files = TlsFiles(cert, key, None)
    first = files.pem
    assert not files.reread() and files._fetch() is None
    cert.write_bytes(pki["next_crt"].read_bytes())  # the key not yet
    assert not files.reread() and files.pem is first and files._fetch() is None
    assert files.refused_now() == 1
    key.write_bytes(pki["next_key"].read_bytes())
    assert files.reread() and files.pem.cert == pki["next_crt"].read_bytes()
    assert files.refused_now() == 0
    assert files._fetch() is not None and files._fetch() is None
    cert.unlink()  # gone: kept as it was
    assert not files.reread() and files.pem.cert == pki["next_crt"].read_bytes()


def test_mha_infer_checks_the_certificate_for_the_name_it_is_told(small_model_dir: Path, pki: dict[str, Path]) -> None:
    """Through a port-forward, --url is 127.0.0.1 while the certificate names the Service: without
    --tls-server-name the name check refuses the server; with it, the answer comes back."""
    settings = _over_tls(small_model_dir, pki["svc_crt"], pki["svc_key"])
    with ServerThread(settings) as s:
        base = ["infer", "--url", s.url, "--shape", "1,4,32", "--tls-ca", str(pki["ca"]), "--timeout", "10"]
        for extra, code in (([], 1), (["--tls-server-name", "mha-serve.serving.svc"], 0)):
            run = subprocess.run(
                [sys.executable, "-m", "service.cli", *base, *extra], capture_output=True, text=True, timeout=120
            )
            assert run.returncode == code, run.stderr
            assert ("output [1, 4, 32]" in run.stdout) == (code == 0), run.stdout + run.stderr


def test_mha_verify_checks_every_route_over_mtls_with_a_token(
    small_model_dir: Path, pki: dict[str, Path], tmp_path: Path
) -> None:
    """`helm test`'s case through a port-forward: the certificate names the Service, clients
    present theirs and a token. Every route answers within the tolerance over gRPC and HTTPS."""
    (token := tmp_path / "token").write_text("verify-token\n")
    settings = _over_tls(
        small_model_dir, pki["svc_crt"], pki["svc_key"], tls_client_ca=pki["ca"], auth_token_file=token, http_port=0
    )
    with ServerThread(settings) as s:
        mtls = ["--tls-ca", str(pki["ca"]), "--tls-client-cert", str(pki["client_crt"])]
        mtls += ["--tls-client-key", str(pki["client_key"]), "--token-file", str(token)]
        base = ["verify", str(small_model_dir), "--url", s.url, "--http-url", f"https://127.0.0.1:{s.http_port}", *mtls]
        named = [*base, "--tls-server-name", "mha-serve.serving.svc"]
        run = subprocess.run([sys.executable, "-m", "service.cli", *named], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    routes = ("gRPC ModelInfer", "gRPC rows batched", "gRPC ModelStreamInfer", "gRPC decode steps", "HTTP JSON")
    routes += ("gRPC steps, reconnecting", "HTTP binary data", "HTTP decode steps")  # each connection over mTLS
    assert all(f"{route:<{ROUTE_WIDTH}} ok " in run.stdout for route in routes), run.stdout
    assert run.stdout.endswith("PASS\n"), run.stdout


def test_tritons_clients_speak_tls_to_it_before_and_after_a_renewal(
    small_model_dir: Path, pki: dict[str, Path], tmp_path: Path
) -> None:
    """tritonclient's gRPC and HTTP clients, in their own environment, trust the server's CA and
    are answered; after a renewal to another CA's certificate, they are answered when they trust
    that one."""
    assert TRITON_PYTHON.exists(), "make install creates .venv-triton with tritonclient"
    files = {"dir": tmp_path, **{name: tmp_path / name for name in ("tls.crt", "tls.key", "ca.crt")}}
    _served(files, pki, "server_crt", "server_key", "ca")
    clock = ManualClock()
    settings = _over_tls(small_model_dir, files["tls.crt"], files["tls.key"], http_port=0)
    script = str(ROOT / "tests" / "e2e" / "triton_tls.py")
    with ServerThread(settings, clock=clock) as s:
        for cert, key, ca in (("server_crt", "server_key", "ca"), ("next_crt", "next_key", "other_ca")):
            _served(files, pki, cert, key, ca)
            s.call(clock.advance_and_settle(10.5))
            out = tmp_path / f"{ca}.json"
            urls = [s.url, f"127.0.0.1:{s.http_port}"]
            args = [str(TRITON_PYTHON), script, *urls, str(pki[ca]), str(X.shape[2]), str(out)]
            run = subprocess.run(args, capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr[-2000:]
            seen = json.loads(out.read_text())
            assert seen == {"grpc_ready": True, "grpc_shape": [1, 4, 32], "http_ready": True, "http_shape": [1, 4, 32]}


def test_perf_analyzer_measures_it_over_tls(small_model_dir: Path, pki: dict[str, Path]) -> None:
    """Triton's perf_analyzer, given the CA as its users give it, over gRPC and HTTPS."""
    settings = _over_tls(small_model_dir, pki["server_crt"], pki["server_key"], http_port=0)
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(str(p) for p in LIBRARIES)}
    with ServerThread(settings) as s:
        modes = {
            "grpc": (s.url, ["--ssl-grpc-use-ssl", "--ssl-grpc-root-certifications-file", str(pki["ca"])]),
            "http": (f"https://127.0.0.1:{s.http_port}", ["--ssl-https-ca-certificates-file", str(pki["ca"])]),
        }
        for protocol, (url, tls) in modes.items():
            command = [str(PERF_ANALYZER), "-m", "mha", "-u", url, "-i", protocol, "--shape", "x:4,32", *SHORT, *tls]
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
            assert run.returncode == 0, f"{protocol}: {run.stdout[-2000:]}\n{run.stderr[-2000:]}"
            assert "Successful request count" in run.stdout and "Throughput:" in run.stdout, run.stdout[-2000:]
