"""Streaming a backup file of one Raft group over HTTP (``raftkv.backup`` has the format).

``GET /v1/snapshot`` serves the default group; ``GET /v1/tables/{t}/partitions/{p}/
snapshot`` one table partition. Either runs on the group's leader: the image is taken
after a ReadIndex round, so it holds every write acknowledged before the request, and it
is streamed from one LMDB read transaction while writes go on. A follower's ReadIndex
fails with ``NotLeader``, which the API answers 421 naming the leader, so the client
retries there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from raftkv.backup import backup_info, frames
from raftkv.node.driver import Node
from raftkv.server.requests import require_leader, wait


async def stream_backup(node: Node, group: str, request: web.Request, filename: str,
                        extra: Callable[[], dict[str, Any]] | None = None,
                        ) -> web.StreamResponse:
    """Answer ``request`` with a backup file of ``group`` (module docstring);
    ``filename`` names it in Content-Disposition (``{index}`` is filled in). ``extra``
    adds fields to the header, read on the loop thread with the image."""
    require_leader(node, group)
    await wait(node.read(group, lambda s: None))  # the ReadIndex round

    def capture() -> tuple[dict[str, Any], Any]:
        g = node.groups[group]
        applied = g.state.applied_index()
        conf = g.raft.conf_at(applied) or g.raft.conf
        info = backup_info(node.id, group, applied, g.raft.log.term(applied), conf)
        if extra is not None:
            info.update(extra())
        return info, g.state.snapshot_chunks()

    info, chunks = await wait(node.call(capture))
    resp = web.StreamResponse(headers={
        "Content-Type": "application/octet-stream",
        "Content-Disposition":
            f'attachment; filename="{filename.format(index=info["index"])}"'})
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    it = frames(info, chunks)
    try:
        while True:
            # Off the event loop: a chunk is up to a MiB read from LMDB (one read
            # transaction, consumed by one thread at a time, as the store allows).
            part = await loop.run_in_executor(None, next, it, None)
            if part is None:
                break
            await resp.write(part)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # a client gone mid-stream must not pin the read transaction
    await resp.write_eof()
    return resp
