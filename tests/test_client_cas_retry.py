"""``Client.cas`` after a lost answer: an unknown outcome, never a definite ``False``.

``Client.request`` sends a request again after a dropped connection, a 503 or a 504.
For a compare-and-set that is not safe: if the first copy applied and only its answer
was lost, the second copy compares against the value the first one wrote and answers
412, and ``cas`` returns ``swapped=False`` for a CAS that swapped. The client module's
docstring recommends ``cas`` precisely for when a retried write matters.

It did that until ``cas`` stopped retrying after an attempt that may have applied: it
now raises ``OutcomeUnknown`` (an ``Unavailable``).
"""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from conftest import read_request_head

from raftkv.client import Client, OutcomeUnknown


def _server() -> tuple[socket.socket, list[bytes]]:
    """A node that reads the first request and dies before answering (its connection is
    reset), then, restarted, answers every request 412 ``{"swapped": false}``."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        for i in range(4):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                seen.append(read_request_head(conn))
                if i == 0:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue  # closed with a reset, no answer: the first copy applied
                body = b'{"index": 5, "swapped": false}'
                conn.sendall(b"HTTP/1.1 412 Precondition Failed\r\nContent-Type: "
                             b"application/json\r\nConnection: close\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)

    threading.Thread(target=serve, daemon=True).start()
    return listener, seen


def test_cas_whose_first_answer_was_lost_does_not_report_a_definite_false() -> None:
    listener, seen = _server()
    port = listener.getsockname()[1]
    client = Client([f"127.0.0.1:{port}"], timeout=3.0)
    try:
        with pytest.raises(OutcomeUnknown, match="may or may not have applied"):
            client.cas("k", "old", "new")
        assert len(seen) == 1  # sent once, not again
    finally:
        client.close()
        listener.close()
