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

RESET = None  # a connection that reads the request and dies before answering


def _http(status: str, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _fake_node(*script: tuple[bytes | None, bool]) -> tuple[socket.socket, list[bytes]]:
    """A node playing ``script``, one ``(answer, keep_alive)`` per connection it
    accepts, the last repeated: ``answer`` is sent to each request on that connection
    (``RESET``: none, the connection is reset, as a node SIGKILLed after applying);
    without ``keep_alive`` the connection closes after the first answer (a server that
    timed it out, or restarted). Returns the listener and the request lines seen."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        for i in range(8):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            answer, keep = script[min(i, len(script) - 1)]
            with conn:
                while True:
                    head = read_request_head(conn)
                    if not head:
                        break
                    if head.startswith(b"GET /health "):
                        # A write's new connection is checked first: answered, not scripted.
                        conn.sendall(_http("200 OK", b'{"id": "n1"}'))
                        continue
                    seen.append(head)
                    if answer is RESET:
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                        break
                    conn.sendall(answer)
                    if not keep:
                        break

    threading.Thread(target=serve, daemon=True).start()
    return listener, seen


def _server() -> tuple[socket.socket, list[bytes]]:
    """Dies before answering the first request, then answers 412 ``{"swapped": false}``."""
    return _fake_node((RESET, False),
                      (_http("412 Precondition Failed", b'{"index": 5, "swapped": false}'), False))


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


OK = _http("200 OK", b'{"index": 7}')


@pytest.mark.parametrize("write", ["put", "delete", "batch"])
def test_a_write_whose_answer_was_lost_is_not_sent_again(write: str) -> None:
    """Found from outside: ``raftkv put`` after a lost answer sent the put again to the
    next endpoint, so one put applied twice (two revisions, two watch events, version 2
    for a new key). etcd's client does not resend; neither does this one now."""
    listener, seen = _fake_node((RESET, False), (OK, True))
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
    listener, seen = _fake_node((OK, False), (OK, True))
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
    listener, seen = _fake_node(
        (_http("503 Service Unavailable",
               b'{"error": "t.p0 is not hosted here; retry", "proposed": false}'), False),
        (_http("200 OK", b'{"index": 9}'), False))
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
    listener, seen = _fake_node((OK, True))
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
