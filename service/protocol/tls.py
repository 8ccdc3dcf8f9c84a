"""The server's certificate, its key and the client CA (--tls-cert, --tls-key, --tls-client-ca):
checked at start, and taken again for new connections of both protocols whenever their files
change, so that a renewed certificate (cert-manager updates its Secret in place) is served
without a restart. Connections already open keep the certificate they began with."""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

from service.protocol.watched import WatchedFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pem:
    """One reading of the files, checked as a TLS server reads them."""

    key: bytes
    cert: bytes
    client_ca: bytes | None
    context: ssl.SSLContext  # HTTP's, built from the same files
    expires: float  # when the certificate (the chain's first) stops being valid, in Unix time

    def grpc_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.client_ca)


class TlsFiles(WatchedFiles):
    """The files, and what each protocol serves from them. gRPC asks `_fetch` at each handshake
    (grpc.dynamic_ssl_server_credentials); HTTP's context hands each handshake to the newest
    context (its SNI callback, which runs whether or not the client names a server)."""

    what, label = "the TLS files", "tls"

    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        super().__init__(cert, key, client_ca)
        self.pem = self.read()  # a ValueError naming the flag: the caller's to refuse at start
        self._lock = threading.Lock()  # gRPC's handshakes call _fetch from its own threads
        self._pending: Pem | None = None  # taken, not yet given to gRPC

    def read(self) -> Pem:
        cert_file, key_file, ca_file = self._paths
        assert cert_file is not None and key_file is not None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(cert_file, key_file)
            key, cert = key_file.read_bytes(), cert_file.read_bytes()
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"--tls-cert {cert_file} with --tls-key {key_file}: {exc}; expected a PEM certificate "
                "and the PEM private key that matches it"
            ) from exc
        expires = x509.load_pem_x509_certificate(cert).not_valid_after_utc.timestamp()
        if expires < time.time():
            log.warning("--tls-cert %s expired at %s: clients will refuse it", cert_file, time.ctime(expires))
        if ca_file is None:
            return Pem(key, cert, None, context, expires)
        try:
            context.load_verify_locations(ca_file)
            client_ca = ca_file.read_bytes()
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--tls-client-ca {ca_file}: {exc}; expected PEM CA certificates") from exc
        context.verify_mode = ssl.CERT_REQUIRED
        return Pem(key, cert, client_ca, context, expires)

    def take(self) -> None:
        pem = self.read()
        with self._lock:
            self.pem = self._pending = pem

    def expires(self) -> float:
        """When the certificate served to new connections expires, in Unix time."""
        return self.pem.expires

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.pem.grpc_configuration(), self._fetch, require_client_authentication=self.pem.client_ca is not None
        )

    def http_context(self) -> ssl.SSLContext:
        first = self.pem.context
        first.sni_callback = self._handshake
        return first

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question at each handshake: None keeps what it serves."""
        with self._lock:
            pem, self._pending = self._pending, None
        return None if pem is None else pem.grpc_configuration()

    def _handshake(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        if (newest := self.pem.context) is not context:
            connection.context = newest
