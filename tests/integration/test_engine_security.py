"""Issue 16, item 5: impossible weight groups are refused at once (the store's address:
tests/unit/test_sync_group.py)."""

from __future__ import annotations

import pytest

from moerl.parallel.spawn import free_port


@pytest.mark.parametrize(
    "values, field",
    [
        ({"rank_offset": 2, "world_size": 2}, "rank_offset"),
        ({"rank_offset": -1, "world_size": 2}, "rank_offset"),
        ({"rank_offset": 1, "world_size": 0}, "world_size"),
        ({"rank_offset": 1, "world_size": 2, "master_port": 70000}, "master_port"),
        ({"rank_offset": "1", "world_size": 2}, "rank_offset"),
    ],
)
def test_impossible_weight_groups_are_400_at_once(http, values, field):
    body = {"master_address": "127.0.0.1", "master_port": free_port(), **values}
    r = http.post("/init_weights_update_group", body, timeout=5)  # not the store's 300 s
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(field)
