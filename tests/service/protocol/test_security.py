"""TLS, mTLS and bearer tokens end to end, with certificates made here."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
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

from service.client.client import InferenceError, MHAClient
from tests.support import ServerThread, make_settings

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
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
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
    return paths


def _tls_client(url: str, pki: dict[str, Path], who: str | None = None, **kw: object) -> MHAClient:
    cert = (pki[f"{who}_key"].read_bytes(), pki[f"{who}_crt"].read_bytes()) if who else None
    return MHAClient(url, root_certificates=pki["ca"].read_bytes(), client_cert=cert, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tls_server(small_model_dir: Path, pki: dict[str, Path]) -> Iterator[ServerThread]:
    settings = make_settings(small_model_dir, tls_cert=pki["server_crt"], tls_key=pki["server_key"], backend="torch")
    with ServerThread(settings) as s:
        yield s


def test_tls(tls_server: ServerThread, pki: dict[str, Path]) -> None:
    with _tls_client(tls_server.url, pki) as client:
        assert client.infer(X).shape == X.shape
    with MHAClient(tls_server.url) as plaintext, pytest.raises(InferenceError) as info:
        plaintext.infer(X, timeout=5)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_mtls(small_model_dir: Path, pki: dict[str, Path]) -> None:
    settings = make_settings(
        small_model_dir, tls_cert=pki["server_crt"], tls_key=pki["server_key"], tls_client_ca=pki["ca"], backend="torch"
    )
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
    settings = make_settings(
        small_model_dir,
        tls_cert=pki["server_crt"],
        tls_key=pki["server_key"],
        tls_client_ca=pki["ca"],
        health_port=0,
        backend="torch",
    )
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

    settings = make_settings(
        small_model_dir, tls_cert=pki["server_crt"], tls_key=pki["server_key"], http_port=0, backend="torch"
    )
    with ServerThread(settings) as s:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        url = f"https://127.0.0.1:{s.http_port}/v2/health/ready"
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            assert response.status == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}/v2/health/ready", timeout=10)
