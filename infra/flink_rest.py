"""Flink's REST API behind mutual TLS, and a read-only front of it for everyone else.

Flink's REST endpoint authenticates nobody: it registers its cancel handler whatever `web.cancel.enable`
says, and its savepoint and stop-with-savepoint handlers with no switch at all (flink-dist 2.3.0's
WebMonitorEndpoint). So the endpoint itself listens at `flink.api_url`
and takes only clients that present the stack's certificate (`security.ssl.rest.authentication-enabled`):
the platform, which submits, checkpoints and cancels its job there. The web UI and every reader (status,
benchmarks, a person's curl) use `flink.rest_url`: a front that passes GET and HEAD through and answers
any other method 405.

The certificate is self-signed, made once per stack by `ensure_credentials` (in the main environment:
it needs `cryptography`) into the Flink service's directory, files mode 600; the rest is standard library,
so the job's process in the Flink environment serves the front.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import ssl
import threading
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from infra.settings import Settings, local_secret

log = logging.getLogger(__name__)

KEYSTORE, CERT, KEY, PASSWORD = "rest.p12", "rest-cert.pem", "rest-key.pem", "rest-keystore-password"


def credentials_dir(s: Settings) -> Path:
    return s.paths.service_dir("flink") / "rest-tls"


def _password(s: Settings) -> str:
    return local_secret(credentials_dir(s) / PASSWORD, nbytes=18)


def ensure_credentials(s: Settings) -> Path:
    """The stack's REST certificate and key (PEM, for the platform's Python clients) and a PKCS#12 keystore
    of both (for Flink: its key store and trust store), made once; their directory."""
    d = credentials_dir(s)
    if all((d / name).exists() for name in (KEYSTORE, CERT, KEY)):
        return d
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import pkcs12
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    host, _ = s.flink.api_host_port
    try:
        alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        alt = x509.DNSName(host)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flywheel flink rest")])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(days=1)).not_valid_after(now + timedelta(days=3650))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            # One certificate for both ends: Flink's endpoint and the platform's client.
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    password = _password(s).encode()
    files = {
        KEY: key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption()),
        CERT: cert.public_bytes(serialization.Encoding.PEM),
        KEYSTORE: pkcs12.serialize_key_and_certificates(b"flink-rest", key, cert, None,
                                                        serialization.BestAvailableEncryption(password)),
    }
    for filename, data in files.items():
        path = d / filename
        path.touch(mode=0o600)
        path.write_bytes(data)
    return d


def ssl_options(s: Settings) -> dict[str, str]:
    """Flink's options for its REST endpoint (server) and REST client alike: TLS, the client's
    certificate required, the stack's keystore as both key store and trust store."""
    d, password = credentials_dir(s), _password(s)
    keystore = str(d / KEYSTORE)
    return {
        "security.ssl.rest.enabled": "true", "security.ssl.rest.authentication-enabled": "true",
        "security.ssl.rest.keystore": keystore, "security.ssl.rest.keystore-password": password,
        "security.ssl.rest.key-password": password,
        "security.ssl.rest.truststore": keystore, "security.ssl.rest.truststore-password": password,
        # Flink's default is one RSA key-exchange suite; the key is an EC one, the exchange ephemeral.
        "security.ssl.algorithms": "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
    }


def client_context(s: Settings) -> ssl.SSLContext:
    """TLS for the platform's calls to `flink.api_url`: the server checked against the stack's certificate,
    the same certificate presented as the client's."""
    d = credentials_dir(s)
    if not (d / KEY).exists():
        raise FileNotFoundError(f"no REST certificate in {d}: `flywheel up` makes it (ensure_credentials)")
    context = ssl.create_default_context(cafile=str(d / CERT))
    context.load_cert_chain(str(d / CERT), str(d / KEY))
    return context


def call(s: Settings, path: str, method: str = "GET", body: dict | None = None, timeout_s: float = 10.0) -> dict:
    """One call to Flink's REST API as the platform (the Flink environment has no HTTP client but urllib)."""
    request = urllib.request.Request(f"{s.flink.api_url.rstrip('/')}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s, context=client_context(s)) as response:
        return json.loads(response.read() or b"{}")


class _ReadOnly(BaseHTTPRequestHandler):
    server: _Front

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._relay()

    def do_HEAD(self) -> None:  # noqa: N802
        self._relay()

    def _refuse(self) -> None:
        self._answer(405, json.dumps({"errors": [
            f"read-only: {self.command} is not served here; Flink's REST API takes changes only from the "
            "platform, over mutual TLS (docs/operations.md)"]}).encode(), "application/json")

    do_POST = do_PUT = do_PATCH = do_DELETE = _refuse  # noqa: N815

    def _relay(self) -> None:
        front = self.server
        request = urllib.request.Request(front.api_url + self.path, method=self.command)
        try:
            with urllib.request.urlopen(request, timeout=10, context=front.context) as response:
                status, body, kind = response.status, response.read(), response.headers.get("Content-Type")
        except urllib.error.HTTPError as exc:
            status, body, kind = exc.code, exc.read(), exc.headers.get("Content-Type")
        except OSError as exc:
            status, body, kind = 502, json.dumps({"errors": [f"Flink's REST API: {exc}"]}).encode(), "application/json"
        self._answer(status, body, kind or "application/octet-stream")

    def _answer(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        log.debug("front: " + format, *args)


class _Front(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, s: Settings) -> None:
        self.api_url, self.context = s.flink.api_url.rstrip("/"), client_context(s)
        super().__init__(s.flink.host_port, _ReadOnly)


def start_front(s: Settings) -> ThreadingHTTPServer:
    """The read-only front at `flink.rest_url`, served from a daemon thread of this process."""
    front = _Front(s)
    threading.Thread(target=front.serve_forever, name="flink-rest-front", daemon=True).start()
    log.info("Flink's web UI and REST API, read-only, at %s", s.flink.rest_url)
    return front
