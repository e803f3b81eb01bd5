"""conftest's --shard K/N: every test in exactly one shard, whole files per shard, loads balanced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.conftest import shard_items


def items(counts: dict[str, int]) -> list:
    return [SimpleNamespace(nodeid=f"{path}::test_{i}") for path, n in counts.items() for i in range(n)]


def test_shards_partition_the_tests_by_file():
    all_items = items({"a.py": 50, "b.py": 30, "c.py": 25, "d.py": 5, "e.py": 1})
    shards = [shard_items(all_items, f"{k}/3") for k in (1, 2, 3)]
    assert sorted(i.nodeid for s in shards for i in s) == sorted(i.nodeid for i in all_items)
    for s in shards:
        for other in shards:
            if other is not s:
                assert not {i.nodeid.split("::")[0] for i in s} & {i.nodeid.split("::")[0] for i in other}
    assert sorted(len(s) for s in shards) == [30, 31, 50]
    assert shard_items(all_items, "1/1") == all_items


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b", "1/0"])
def test_bad_shards_are_refused(bad):
    with pytest.raises(pytest.UsageError, match="--shard"):
        shard_items(items({"a.py": 1}), bad)
