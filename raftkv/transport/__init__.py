"""Authenticated, framed, many-groups-per-connection transport on PySyncObj's poller.

- ``frames``: length + version framing and the incremental decoder (size-capped).
- ``codec``: Raft messages and forwarded requests to and from msgpack, validated strictly.
- ``handshake``: the HMAC challenge both peers pass before a single frame is decoded.
- ``tcp``: connections, dialing with back-off, per-peer batching, the test fault switch.
"""
