"""``KeyCache``: the placement cache's index of each partition's holds keys always equals
what a scan of the whole cache finds (``raftkv.placement.key_cache``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raftkv.placement.catalog import holds_key, holds_prefix, incarnation_key, partition_group
from raftkv.placement.key_cache import KeyCache, holds_group, holds_partition
from raftkv.placement.meta_commands import VersionedValue

TABLES = ["t", "users", "a-b_c"]
NODES = ["n1", "n2", "10.0.0.1:7000", "a.b.c"]  # node ids may have dots

keys = st.one_of(
    st.builds(holds_key, st.sampled_from(TABLES), st.integers(0, 12), st.sampled_from(NODES)),
    st.builds(incarnation_key, st.sampled_from(NODES)),
    st.sampled_from([b"placement.topology", b"placement.holds.", b"placement.holds.t",
                     b"placement.holds.t.3", b"other"]),
)
ops = st.lists(st.tuples(st.sampled_from(["set", "pop", "del"]), keys,
                         st.binary(max_size=6)), max_size=60)


def _scan(cache: dict[bytes, VersionedValue], prefix: bytes) -> dict[bytes, VersionedValue]:
    return {k: v for k, v in cache.items() if k.startswith(prefix)}


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_index_equals_a_scan_after_any_writes(script: list[tuple[str, bytes, bytes]]) -> None:
    cache = KeyCache()
    plain: dict[bytes, VersionedValue] = {}
    for rev, (op, key, value) in enumerate(script, 1):
        if op == "set":
            cache[key] = plain[key] = VersionedValue(value, rev, rev)
        elif op == "pop":
            assert cache.pop(key, None) == plain.pop(key, None)
        elif key in plain:
            del cache[key]
            del plain[key]
    assert dict(cache) == plain
    for table in TABLES:
        for p in range(13):
            prefix = holds_prefix(table, p)
            assert dict(cache.holds_of(prefix)) == _scan(plain, prefix)
    assert KeyCache(plain.items()) == plain


def test_holds_keys_name_their_partition() -> None:
    assert holds_partition(holds_key("users", 7, "a.b.c")) == holds_prefix("users", 7)
    assert holds_group(holds_key("users", 7, "a.b.c")) == partition_group("users", 7)
    for other in (incarnation_key("n1"), b"placement.holds.", b"placement.holds.t",
                  b"placement.holds.t.x.n1"):
        assert holds_group(other) is None


@pytest.mark.parametrize("write", ["update", "setdefault", "popitem", "clear"])
def test_writes_that_would_bypass_the_index_are_refused(write: str) -> None:
    cache = KeyCache([(b"k", VersionedValue(b"v", 1, 1))])
    with pytest.raises(TypeError):
        getattr(cache, write)({}) if write in ("update", "setdefault") else getattr(
            cache, write)()
    assert cache == {b"k": VersionedValue(b"v", 1, 1)}
