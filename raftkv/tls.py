"""TLS settings for the HTTP API, the peer transport and the client (standard library only).

One ``TlsConfig`` names a certificate, its key and the CA that signs the other side's
certificate, as etcd's ``--cert-file``/``--key-file``/``--trusted-ca-file``/
``--client-cert-auth`` do (and ``--peer-...`` for the peer port). It builds the two
``ssl.SSLContext`` objects a node needs:

- ``server_context``: presents the certificate; with ``client_cert_auth`` it also
  requires the other side to present one signed by the trusted CA (mutual TLS).
- ``client_context``: verifies the server's certificate against the trusted CA,
  including that it names the host or IP address dialed (as a browser does), and
  presents this certificate in case the server asks for one.

A node uses its peer ``TlsConfig`` both ways (it accepts and dials peers), so a peer
certificate needs both the serverAuth and clientAuth extended key usages (or none), and
a subject alternative name for every host or IP address peers dial it at.
``raftkv.certs`` makes such certificates for tests and the demo; docs/security.md shows
the same with openssl.

TLS 1.2 is the oldest version either side accepts (1.3 is used when both have it); the
cipher suites are Python's defaults (forward-secret key exchange only).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass


class TlsSetupError(ValueError):
    """A certificate, key or CA file is missing or does not load (say which, say why)."""


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str
    key_file: str
    trusted_ca_file: str | None = None  # None: the system's CAs
    client_cert_auth: bool = False  # as a server: require a client certificate

    def __post_init__(self) -> None:
        if self.client_cert_auth and not self.trusted_ca_file:
            raise TlsSetupError("client certificate authentication needs a trusted CA file")

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_chain(ctx)
        if self.client_cert_auth:
            ctx.verify_mode = ssl.CERT_REQUIRED
            _load_ca(ctx, self.trusted_ca_file)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = client_context(self.trusted_ca_file)
        self._load_chain(ctx)
        return ctx

    def _load_chain(self, ctx: ssl.SSLContext) -> None:
        for what, path in (("certificate", self.cert_file), ("key", self.key_file)):
            if not os.path.isfile(path):
                raise TlsSetupError(f"TLS {what} file {path} "
                                    + _not_a_file(path))
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as e:
            raise TlsSetupError(f"cannot load the TLS certificate {self.cert_file} with the "
                                f"key {self.key_file}: {e}") from None


def client_context(ca_file: str | None, cert_file: str | None = None,
                   key_file: str | None = None) -> ssl.SSLContext:
    """A context that verifies servers against ``ca_file`` (None: the system's CAs) and
    host names, presenting ``cert_file``/``key_file`` if given (mutual TLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_file:
        _load_ca(ctx, ca_file)
    else:
        ctx.load_default_certs()
    if cert_file or key_file:
        if not (cert_file and key_file):
            raise TlsSetupError("a client certificate needs both a certificate and a key file")
        TlsConfig(cert_file, key_file, ca_file)._load_chain(ctx)
    return ctx


def _not_a_file(path: str) -> str:
    return "is a directory, not a file" if os.path.isdir(path) else "does not exist"


def _load_ca(ctx: ssl.SSLContext, path: str | None) -> None:
    assert path is not None
    if not os.path.isfile(path):
        raise TlsSetupError(f"trusted CA file {path} " + _not_a_file(path))
    try:
        ctx.load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as e:
        raise TlsSetupError(f"cannot load the trusted CA file {path}: {e}") from None
