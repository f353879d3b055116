"""``raftkv.server.http_import``: the HTTP stack is imported without loading CA bundles
for aiohttp's unused default client contexts, on the importing thread only, and every
such context fails closed (it verifies, and trusts nothing)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import textwrap
import threading

from raftkv.server.http_import import no_default_trust_here


def _trusted(ctx: ssl.SSLContext) -> int:
    return ctx.cert_store_stats()["x509_ca"]


def test_only_the_calling_thread_skips_the_trust_store_and_everything_is_put_back() -> None:
    baseline = _trusted(ssl.create_default_context())
    real = ssl.create_default_context
    elsewhere: list[int] = []
    with no_default_trust_here():
        here = ssl.create_default_context()
        assert here.verify_mode == ssl.CERT_REQUIRED and here.check_hostname
        assert _trusted(here) == 0
        bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        bare.set_default_verify_paths()
        assert _trusted(bare) == 0
        t = threading.Thread(target=lambda: elsewhere.append(
            _trusted(ssl.create_default_context())))
        t.start()
        t.join()
        # A CA file of one's own is still loaded.
        bundle = ssl.get_default_verify_paths().openssl_cafile
        if os.path.isfile(bundle):
            assert _trusted(ssl.create_default_context(cafile=bundle)) > 0
    assert elsewhere == [baseline]
    assert ssl.create_default_context is real
    assert "set_default_verify_paths" not in ssl.SSLContext.__dict__
    assert _trusted(ssl.create_default_context()) == baseline


def test_serve_imports_aiohttp_with_contexts_that_trust_nothing() -> None:
    """In a fresh interpreter, as ``raftkv serve`` starts: aiohttp's two default
    contexts load no CA (the time saved), the verifying one still verifies (fails
    closed), and the process's own default contexts are untouched."""
    code = textwrap.dedent("""
        import ssl
        from raftkv.server.http_import import import_http_stack
        before = ssl.create_default_context().cert_store_stats()["x509_ca"]
        import_http_stack()
        import aiohttp.connector as c
        v, u = c._SSL_CONTEXT_VERIFIED, c._SSL_CONTEXT_UNVERIFIED
        assert v.cert_store_stats()["x509_ca"] == 0, v.cert_store_stats()
        assert u.cert_store_stats()["x509_ca"] == 0, u.cert_store_stats()
        assert v.verify_mode == ssl.CERT_REQUIRED and v.check_hostname
        assert ssl.create_default_context().cert_store_stats()["x509_ca"] == before
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
