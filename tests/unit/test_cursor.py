"""The data cursor hands out prompts in order, retries first; ``prefetch`` makes the
next prompts ahead of time without changing what is handed out, or the resume state."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from moerl.rollout.cursor import DataCursor, Item
from moerl.tasks.base import Prompt


class Counting:
    """Prompt i is [i]; counts the prompts it made (a task's prompts cost work)."""

    def __init__(self, num_prompts: int) -> None:
        self.num_prompts, self.made = num_prompts, 0

    def prompts(self, start: int = 0) -> Iterator[Prompt]:
        for i in range(start, self.num_prompts):
            self.made += 1
            yield Prompt(i, np.array([i], np.int32))


def _positions(cursor: DataCursor, n: int) -> list[int | None]:
    return [None if (item := cursor.next()) is None else item.pos for _ in range(n)]


def test_prefetched_prompts_are_handed_out_in_order_retries_first():
    task = Counting(6)
    cursor = DataCursor(task)  # type: ignore[arg-type]
    assert cursor.next().pos == 0  # type: ignore[union-attr]
    cursor.prefetch(3)
    assert task.made == 4  # positions 1-3 made now
    cursor.prefetch(3)
    assert task.made == 4  # already that many ahead
    cursor.retry(Item(0, 1, Prompt(0, np.array([0], np.int32))))
    first = cursor.next()
    assert (first.pos, first.attempt) == (0, 1)  # type: ignore[union-attr]
    assert _positions(cursor, 3) == [1, 2, 3] and task.made == 4  # no new prompt made
    assert _positions(cursor, 3) == [4, 5, None]
    cursor.prefetch(2)  # the task has no more: nothing to make


def test_prefetching_leaves_the_resume_state_alone():
    task = Counting(8)
    cursor = DataCursor(task)  # type: ignore[arg-type]
    assert _positions(cursor, 2) == [0, 1]
    cursor.prefetch(4)  # positions 2-5 made, none handed out or settled
    cursor.settle(1)
    assert cursor.state_dict() == {"cursor": 0, "settled": [1]}
    resumed = DataCursor(Counting(8))  # type: ignore[arg-type]
    resumed.load_state_dict(cursor.state_dict())
    assert _positions(resumed, 3) == [0, 2, 3]
    # loading a state drops what was made ahead: the state says what comes next
    cursor.load_state_dict({"cursor": 4, "settled": [5]})
    assert _positions(cursor, 3) == [4, 6, 7]
