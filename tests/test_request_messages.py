"""Error messages that quote the request back must quote it right (found from outside:
a batch refused with a message describing the very body it refused; a long
``?prev_index`` quoted cut to 24 digits, as if that was what had been sent)."""

from __future__ import annotations

import msgpack
import pytest
from raftkv.storage.commands import CommandError

from raftkv.server.requests import decode_batch_body, quoted


def test_a_quote_is_whole_or_visibly_cut() -> None:
    assert quoted("9" * 26) == repr("9" * 26)
    assert quoted("x" * 50) == repr("x" * 40) + "..."


def test_a_refused_batch_body_is_told_the_form_its_content_type_takes() -> None:
    with pytest.raises(CommandError, match=r'a JSON batch is \{"ops": \[\[key, value\]'):
        decode_batch_body(b'[["a", "1"], ["b", null]]', "application/json")
    with pytest.raises(CommandError, match=r"a msgpack batch is an array of \[key, value"):
        decode_batch_body(msgpack.packb("ops"), "application/x-msgpack")
    assert decode_batch_body(b'{"ops": [["a", "1"], ["b", null]]}', "application/json") == [
        (b"a", b"1"), (b"b", None)]


@pytest.mark.parametrize("body, ctype", [(b'{"ops": []}', "application/json"),
                                         (msgpack.packb([]), "application/x-msgpack")])
def test_a_batch_of_no_operations_is_refused(body: bytes, ctype: str) -> None:
    with pytest.raises(CommandError, match="a batch needs at least one operation"):
        decode_batch_body(body, ctype)
