"""Admission control: a bounded number of in-flight sequences, FIFO when waiting.

Capacity is ``max_num_seqs`` (the running batch) + ``max_queue`` (sequences allowed to
wait for a batch slot). A request of P prompts with ``n`` completions each needs P * n
slots. Policy "reject" answers 503 at once when they are not free; "wait" queues the
request in arrival order until they are, at most ``max_waiting`` requests (then 503: each
waiter holds its parsed body and prompt). ``close`` (shutdown) turns every waiter and
every later request away. Lives on the event loop: not thread-safe.
"""
from __future__ import annotations

import asyncio
from collections import deque

POLICIES = ("reject", "wait")


class QueueFull(Exception):
    pass


class Closed(Exception):
    pass


class Admission:
    def __init__(self, capacity: int, policy: str = "reject", max_waiting: int = 256):
        if max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {max_waiting}")
        if capacity < 1:
            raise ValueError(f"admission capacity must be >= 1, got {capacity}")
        if policy not in POLICIES:
            raise ValueError(f"queue_full_policy must be one of {POLICIES}, got {policy!r}")
        self.capacity = capacity
        self.policy = policy
        self.max_waiting = max_waiting
        self.num_in_use = 0
        self.closed_reason: str | None = None
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def can_acquire(self, num_slots: int) -> bool:
        return not self._waiters and self.num_in_use + num_slots <= self.capacity

    async def acquire(self, num_slots: int) -> None:
        """Take ``num_slots`` or raise QueueFull ("reject") / wait for them ("wait")."""
        if num_slots > self.capacity:
            raise ValueError(f"the request needs {num_slots} sequences (prompts x n), more than this server's "
                             f"capacity of {self.capacity}")
        if self.closed_reason is not None:
            raise Closed(self.closed_reason)
        if self.can_acquire(num_slots):
            self.num_in_use += num_slots
            return
        if self.policy == "reject":
            raise QueueFull(f"server is at capacity ({self.num_in_use}/{self.capacity} sequences in flight); "
                            "retry later")
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull(f"server is at capacity ({self.num_in_use}/{self.capacity} sequences in flight) and "
                            f"{len(self._waiters)} requests already wait (--max-waiting {self.max_waiting}); "
                            "retry later")
        future = asyncio.get_running_loop().create_future()
        entry = (num_slots, future)
        self._waiters.append(entry)
        try:
            await future  # release() hands the slots over before waking us
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(num_slots)  # granted and cancelled in the same tick: give them back
            else:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                self._wake()
            raise

    def close(self, reason: str) -> None:
        """Turn away every waiter (``Closed(reason)``) and every later ``acquire``."""
        self.closed_reason = reason
        while self._waiters:
            _, future = self._waiters.popleft()
            if not future.done():
                future.set_exception(Closed(reason))

    def release(self, num_slots: int) -> None:
        self.num_in_use -= num_slots
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.num_in_use + self._waiters[0][0] <= self.capacity:
            num_slots, future = self._waiters.popleft()
            if not future.done():
                self.num_in_use += num_slots
                future.set_result(None)
