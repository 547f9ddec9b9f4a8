"""The data cursor: which prompt the orchestrator generates next, and what resumes where.

A prompt is *settled* once its group was put in the buffer, dropped by the filter or
cancelled by over-sampling. Groups finish out of order, so the state is the position of
the first unsettled prompt (`cursor`) plus the settled positions beyond it. Resuming from
that state generates every unsettled prompt, in order, and no settled one: nothing that
reached the buffer is generated twice, nothing is skipped. Prompts whose generation failed
come back (`retry`) ahead of new ones. The orchestrator makes the next prompts ahead
(`prefetch`) once a group finished generating, so a synchronous step's launch only posts
them; prompts made ahead are not settled, and a resume makes them again.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moerl.tasks.base import Prompt, Task


@dataclass(order=True)
class Item:
    """One prompt to generate: its stream position and how many times it was tried."""

    pos: int
    attempt: int = field(default=0, compare=False)
    prompt: Prompt | None = field(default=None, compare=False)


class DataCursor:
    """Hands out the task's prompts in order, skipping settled ones; see the docstring."""

    def __init__(self, task: Task, start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"start_cursor={start} must be >= 0")
        self.task = task
        self._cursor = int(start)
        self._settled: set[int] = set()  # settled positions beyond the cursor
        self._retry: list[Item] = []  # heap by position
        self._prompts: Iterator[Prompt] | None = None
        self._next_pos = self._cursor
        self._exhausted = False
        self._ahead: collections.deque[Item] = collections.deque()  # ``prefetch``'s

    @property
    def cursor(self) -> int:
        """Position of the first prompt not yet settled."""
        return self._cursor

    def next(self) -> Item | None:
        """The prompt to generate next (a retry first), None when the task has no more."""
        if self._retry:
            return heapq.heappop(self._retry)
        if self._ahead:
            return self._ahead.popleft()
        return self._fresh()

    def prefetch(self, count: int) -> None:
        """Make the next ``count`` new prompts now (``next`` then hands them out as it
        would have made them): the orchestrator does, while it waits for room, so a
        synchronous step's prompts are ready when the step may start."""
        while len(self._ahead) < count:
            item = self._fresh()
            if item is None:
                return
            self._ahead.append(item)

    def _fresh(self) -> Item | None:
        """The task's next unsettled prompt, None when it has no more."""
        if self._prompts is None:
            self._prompts = iter(self.task.prompts(self._next_pos))
        while not self._exhausted:
            try:
                prompt = next(self._prompts)
            except StopIteration:
                self._exhausted = True
                break
            pos = self._next_pos
            self._next_pos += 1
            if pos not in self._settled:
                return Item(pos, 0, prompt)
        return None

    def retry(self, item: Item) -> None:
        """Generate `item` again before any new prompt."""
        heapq.heappush(self._retry, item)

    def settle(self, pos: int) -> None:
        """The group of prompt `pos` reached the buffer or was dropped on purpose."""
        if pos < self._cursor:
            return
        self._settled.add(pos)
        while self._cursor in self._settled:
            self._settled.remove(self._cursor)
            self._cursor += 1

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the cursor and the settled positions beyond it."""
        return {"cursor": self._cursor, "settled": sorted(self._settled)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state_dict: every unsettled prompt again, in order."""
        self._cursor = self._next_pos = int(state["cursor"])
        self._settled = {int(p) for p in state.get("settled", ()) if int(p) >= self._cursor}
        self._retry = []
        self._ahead.clear()
        self._prompts = None
        self._exhausted = False
