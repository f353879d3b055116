"""``Client.create_table`` after a lost answer: its own table, not a 409.

``Client.request`` sends a request again after a dropped connection, a 503 or a 504. A
create whose first copy made the table and only lost its answer then meets its own table:
409 "already exists", for a create that succeeded (seen under load in
``test_drop_a_table_under_load_on_it_and_on_another``). ``create_table`` now answers
with the table when it retried and the table that exists is the one it asked for; a
table of that name made differently, or a 409 at the first attempt, is still a 409.
"""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest
from conftest import read_request_head

from raftkv.client import Client, ClientError

USERS = {"name": "users", "partitions": 8, "replicas": 3, "storage": "persistent"}


def _answer(conn: socket.socket, status: str, doc: dict) -> None:
    body = json.dumps(doc).encode()
    conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: "
                 f"close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)


def _server(reset_first: bool, listed: dict) -> tuple[socket.socket, list[bytes]]:
    """A node whose first create is reset before any answer (if ``reset_first``: it
    applied, the answer was lost), whose creates then answer 409, and whose table list
    holds ``listed``."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def serve() -> None:
        creates = 0
        for _ in range(6):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                line = read_request_head(conn)
                seen.append(line)
                if line.startswith(b"POST"):
                    creates += 1
                    if reset_first and creates == 1:
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                        continue
                    _answer(conn, "409 Conflict", {"error": "table users already exists"})
                else:
                    _answer(conn, "200 OK", {"tables": [listed]})

    threading.Thread(target=serve, daemon=True).start()
    return listener, seen


def _create(reset_first: bool, listed: dict) -> tuple[object, list[bytes]]:
    listener, seen = _server(reset_first, listed)
    client = Client([f"127.0.0.1:{listener.getsockname()[1]}"], timeout=3.0)
    try:
        return client.create_table("users", 8, 3), seen
    finally:
        client.close()
        listener.close()


def test_a_retried_create_that_finds_its_own_table_succeeds() -> None:
    desc, seen = _create(True, USERS)
    assert desc == USERS
    assert [s.split(b" ")[0] for s in seen] == [b"POST", b"POST", b"GET"]


def test_a_retried_create_that_finds_another_table_is_a_conflict() -> None:
    with pytest.raises(ClientError) as e:
        _create(True, {**USERS, "replicas": 1})
    assert e.value.status == 409


def test_a_create_refused_at_once_is_a_conflict() -> None:
    """No retry, so nothing of ours can be there: the table was someone else's."""
    with pytest.raises(ClientError) as e:
        _create(False, USERS)
    assert e.value.status == 409
