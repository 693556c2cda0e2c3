"""HTTPS for ``kvload serve``: vLLM's ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs`` and ``--ssl-cert-reqs``,
checked before the model loads and handed to uvicorn, which serves TLS itself."""

from __future__ import annotations

import os
import ssl
from typing import Any

import attrs

from pipeline.errors import ConfigError
from pipeline.limits import short_text

#: ``--ssl-cert-reqs`` values, Python's ``ssl.VerifyMode`` (vLLM takes the integer), → what each asks of a client
CERT_REQS = {0: "no client certificate (CERT_NONE, the default)", 1: "a client certificate checked if sent "
             "(CERT_OPTIONAL)", 2: "a client certificate, required (CERT_REQUIRED)"}


@attrs.frozen
class Tls:
    """The PEM files a server answers HTTPS with, as uvicorn takes them (``uvicorn.Config``'s ``ssl_*``)."""

    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` keywords serving these files."""
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": self.cert_reqs}


def tls_from_flags(keyfile: str | None, certfile: str | None, ca_certs: str | None,
                   cert_reqs: int | None) -> Tls | None:
    """The flags' :class:`Tls`, each file loaded as uvicorn will load it (so a bad one is one line now, not a
    traceback after minutes of loading); None without ``--ssl-certfile`` and ``--ssl-keyfile``. ``ConfigError``
    naming the flag otherwise."""
    if certfile is None:
        if keyfile is not None:  # uvicorn would take it as plain HTTP with a key nobody reads, or fail later
            raise ConfigError(f"--ssl-keyfile {short_text(keyfile)}: needs --ssl-certfile CERT (the certificate the "
                              "key belongs to)")
        for flag, value in (("--ssl-ca-certs", ca_certs), ("--ssl-cert-reqs", cert_reqs)):
            if value is not None:  # no TLS to check client certificates in: the server would serve plain HTTP
                raise ConfigError(f"{flag} {short_text(str(value))}: needs --ssl-certfile CERT and --ssl-keyfile KEY "
                                  "(the server serves plain HTTP without them)")
        return None
    reqs = 0 if cert_reqs is None else cert_reqs
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs)):
        if path is not None and not os.path.isfile(path):  # named here: OpenSSL's error would not say which file
            what = "no such file" if not os.path.exists(path) else "not a regular file"
            raise ConfigError(f"{flag} {short_text(path)}: {what}")
    if reqs and ca_certs is None:  # nothing to verify a client's certificate against: every handshake would fail
        raise ConfigError(f"--ssl-cert-reqs {reqs}: asks for {CERT_REQS[reqs]}, which needs --ssl-ca-certs CA (the "
                          "certificates clients' are checked against)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if not _has_certificate("--ssl-certfile", certfile):
        raise ConfigError(f"--ssl-certfile {short_text(certfile)}: no PEM certificate in it (-----BEGIN "
                          "CERTIFICATE-----)")
    try:
        # an encrypted key would make OpenSSL prompt on the terminal, in uvicorn, after the load: refused instead
        context.load_cert_chain(certfile, keyfile, password=lambda: b"")
    except ssl.SSLError as exc:
        if keyfile is None:
            raise ConfigError(f"--ssl-certfile {short_text(certfile)}: holds no private key for its certificate; "
                              f"give --ssl-keyfile KEY ({_reason(exc)})") from None
        raise ConfigError(f"--ssl-keyfile {short_text(keyfile)}: not an unencrypted PEM private key of "
                          f"--ssl-certfile's certificate ({_reason(exc)})") from None
    except OSError as exc:  # unreadable (permissions)
        raise ConfigError(f"--ssl-certfile {short_text(certfile)}: cannot read it ({exc.strerror})") from None
    if ca_certs is not None and not _has_certificate("--ssl-ca-certs", ca_certs):
        raise ConfigError(f"--ssl-ca-certs {short_text(ca_certs)}: no PEM certificate in it (-----BEGIN "
                          "CERTIFICATE-----)")
    return Tls(certfile=certfile, keyfile=keyfile, ca_certs=ca_certs, cert_reqs=reqs)


def cert_reqs(text: str) -> int:
    """``--ssl-cert-reqs``: 0, 1 or 2 (Python's ``ssl.CERT_NONE``, ``CERT_OPTIONAL``, ``CERT_REQUIRED``)."""
    import argparse

    if text.strip() not in ("0", "1", "2"):
        raise argparse.ArgumentTypeError(f"expected 0 (no client certificate), 1 (optional) or 2 (required), got "
                                         f"{short_text(text)}")
    return int(text)


def _has_certificate(flag: str, path: str) -> bool:
    """Whether ``path`` holds a PEM certificate OpenSSL reads (as a CA file reads them)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except (ssl.SSLError, UnicodeDecodeError, ValueError):
        return False
    except OSError as exc:
        raise ConfigError(f"{flag} {short_text(path)}: cannot read it ({exc.strerror})") from None
    return True


def _reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason, short (``KEY_VALUES_MISMATCH``, ``PEM lib``)."""
    import re

    said = str(exc.reason or exc.strerror or exc)
    return "OpenSSL: " + re.sub(r"^\[\w+\] | \(_ssl\.c:\d+\)$", "", said)


__all__ = ["CERT_REQS", "Tls", "cert_reqs", "tls_from_flags"]
