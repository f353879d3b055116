"""Importing the HTTP stack without the TLS trust stores nobody uses.

aiohttp builds two client TLS contexts when its ``connector`` module is imported
(``_SSL_CONTEXT_VERIFIED`` and ``_SSL_CONTEXT_UNVERIFIED``, created at import on purpose
so that no event loop blocks on the disk later), and each loads the system's CA bundle:
about 20 ms of CPU apiece on an idle core, 60-90 ms on a busy one, in every ``raftkv
serve`` start. A node never uses them. Its only aiohttp client is the table proxy, which
speaks plain HTTP to the other nodes when the API has no TLS and presents its own context
(``--trusted-ca-file``) when it has; the command-line client is ``http.client``.

So ``import_http_stack`` imports the API's modules while, on this thread only, creating
a default context and loading the default verify paths do nothing: the two contexts are
made without any trusted CA. That fails closed: a request that did reach for them (an
``https://`` URL with aiohttp's default ``ssl=True``) would be refused for an unverifiable
certificate, never trust one it should not. Every other thread (the node opening at the
same time may build its peer TLS contexts) and everything after the import get the real
functions back. If aiohttp is already loaded (a test that imported it), nothing changes.
"""

from __future__ import annotations

import importlib
import ssl
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any


def import_http_stack() -> None:
    """Import ``raftkv.server.app`` and ``raftkv.server.tables`` (and aiohttp with them)
    without loading CA bundles on this thread (module docstring)."""
    # Already loaded (a test imported aiohttp): nothing is built, nothing to skip.
    loaded = "aiohttp.connector" in sys.modules
    with nullcontext() if loaded else no_default_trust_here():
        for module in ("raftkv.server.app", "raftkv.server.tables"):
            importlib.import_module(module)


# One patch at a time: a second one inside the first would take its wrappers for the
# real functions and put them back when it ends (found in review).
_PATCHING = threading.Lock()


@contextmanager
def no_default_trust_here() -> Iterator[None]:
    """While inside, on the calling thread only, the system's trust store is not loaded:
    ``ssl.create_default_context()`` makes a verifying client context that trusts no CA
    and ``SSLContext.set_default_verify_paths`` does nothing. A CA file named explicitly
    (``cafile=``, ``load_verify_locations``) still loads."""
    with _PATCHING:
        me = threading.get_ident()
        real_default = ssl.create_default_context
        shadowed = "set_default_verify_paths" in ssl.SSLContext.__dict__
        real_paths = ssl.SSLContext.set_default_verify_paths

        def default_context(*args: Any, **kw: Any) -> ssl.SSLContext:
            if threading.get_ident() != me or args or kw:
                return real_default(*args, **kw)
            return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname

        def default_paths(self: ssl.SSLContext) -> None:
            if threading.get_ident() != me:
                real_paths(self)

        ssl.create_default_context = default_context  # type: ignore[assignment]
        ssl.SSLContext.set_default_verify_paths = default_paths  # type: ignore[method-assign]
        try:
            yield
        finally:
            ssl.create_default_context = real_default
            if shadowed:
                ssl.SSLContext.set_default_verify_paths = real_paths  # type: ignore[method-assign]
            else:
                del ssl.SSLContext.set_default_verify_paths
