"""``then``: derive one ``concurrent.futures.Future`` from another.

The driver resolves futures on its loop thread; callers want the part of the result
that concerns them (the index, the swapped flag, the method's return value). ``then``
maps the result through ``fn`` and passes exceptions (from the source or from ``fn``)
through unchanged, so every layer reports errors the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

T = TypeVar("T")


def then(source: Future[Any], fn: Callable[[Any], T]) -> Future[T]:
    out: Future[T] = Future()

    def settle(f: Future[Any]) -> None:
        if out.cancelled():
            return
        try:
            if f.cancelled():
                out.cancel()
                return
            error = f.exception()
            if error is not None:
                out.set_exception(error)
                return
            try:
                value = fn(f.result())
            except Exception as e:  # noqa: BLE001 - fn's failure belongs to the caller
                out.set_exception(e)
                return
            out.set_result(value)
        except InvalidStateError:
            pass  # the caller cancelled ``out`` meanwhile

    source.add_done_callback(settle)
    return out
