"""``Client.cas`` after a lost answer: an unknown outcome, never a definite ``False``.

``Client.request`` sends a request again after a dropped connection, a 503 or a 504.
For a compare-and-set that is not safe: if the first copy applied and only its answer
was lost, the second copy compares against the value the first one wrote and answers
412, and ``cas`` returns ``swapped=False`` for a CAS that swapped. The client module's
docstring recommends ``cas`` precisely for when a retried write matters.

It did that until ``cas`` stopped retrying after an attempt that may have applied: it
now raises ``OutcomeUnknown`` (an ``Unavailable``). So do every other write (a put sent
again applies twice) since; a kept-alive connection the server closed is replaced
before a write goes out, so that case is no unknown outcome.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

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


def _answering(first: str) -> tuple[socket.socket, list[bytes]]:
    """A node whose first connection reads a request and then, per ``first``: ``reset``
    (dies before answering, as a leader SIGKILLed after applying) or ``idle`` (answers,
    then closes the kept-alive connection, as a server timing it out or restarting).
    Every later request is answered 200."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []
    body = b'{"index": 7}'
    ok = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
          + str(len(body)).encode() + b"\r\n\r\n" + body)

    def serve() -> None:
        for i in range(6):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                seen.append(read_request_head(conn))
                if i == 0 and first == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue
                conn.sendall(ok)
                if i == 0 and first == "idle":
                    continue  # closed after the answer: the client's kept-alive copy is stale
                while True:  # keep-alive: answer whatever else comes on this connection
                    head = read_request_head(conn)
                    if not head:
                        break
                    seen.append(head)
                    conn.sendall(ok)

    threading.Thread(target=serve, daemon=True).start()
    return listener, seen


@pytest.mark.parametrize("write", ["put", "delete", "batch"])
def test_a_write_whose_answer_was_lost_is_not_sent_again(write: str) -> None:
    """Found from outside: ``raftkv put`` after a lost answer sent the put again to the
    next endpoint, so one put applied twice (two revisions, two watch events, version 2
    for a new key). etcd's client does not resend; neither does this one now."""
    listener, seen = _answering("reset")
    client = Client([f"127.0.0.1:{listener.getsockname()[1]}"], timeout=3.0)
    try:
        with pytest.raises(OutcomeUnknown, match="may or may not have applied"):
            {"put": lambda: client.put("k", "v"), "delete": lambda: client.delete("k"),
             "batch": lambda: client.batch([("k", "v")])}[write]()
        assert len(seen) == 1
    finally:
        client.close()
        listener.close()


def test_a_kept_alive_connection_the_server_closed_is_replaced_before_a_write() -> None:
    """The other side of sending a write once: a connection the server has closed
    (timed out, or the node restarted) is noticed before the request goes out, so the
    write is sent on a new one rather than reported unknown."""
    listener, seen = _answering("idle")
    client = Client([f"127.0.0.1:{listener.getsockname()[1]}"], timeout=3.0)
    try:
        assert client.put("a", "1") == 7
        time.sleep(0.2)  # the server's close reaches the client's socket
        assert client.put("b", "2") == 7
        assert [h.split()[1] for h in seen] == [b"/v1/kv/a", b"/v1/kv/b"]
    finally:
        client.close()
        listener.close()


def test_a_write_refused_with_proposed_false_is_sent_again() -> None:
    """Found in review: a table partition that just moved answers 503 "not hosted here;
    retry", which proposed nothing; a write sent at most once took it for an unknown
    outcome. The answer says ``"proposed": false`` and the client sends it again."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        for i in range(2):
            conn, _ = listener.accept()
            with conn:
                seen.append(read_request_head(conn))
                body = (b'{"error": "t.p0 is not hosted here; retry", "proposed": false}'
                        if i == 0 else b'{"index": 9}')
                status = b"503 Service Unavailable" if i == 0 else b"200 OK"
                conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)

    threading.Thread(target=serve, daemon=True).start()
    client = Client([f"127.0.0.1:{listener.getsockname()[1]}"], timeout=5.0)
    try:
        assert client.put("k", "v") == 9
        assert len(seen) == 2
    finally:
        client.close()
        listener.close()


def test_a_kept_alive_connection_on_a_high_descriptor_is_reused() -> None:
    """Found in review: the stale-connection check used select(), which refuses
    descriptors from 1,024 on, so every second request of a process holding many files
    raised ValueError."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    listener, seen = _answering("keep")
    client = Client([f"127.0.0.1:{listener.getsockname()[1]}"], timeout=3.0)
    try:
        assert client.put("a", "1") == 7
        assert client.put("b", "2") == 7  # on the same connection, fd >= 1024
        assert len(seen) == 2
    finally:
        client.close()
        listener.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
