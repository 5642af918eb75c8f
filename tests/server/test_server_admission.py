"""Admission (no server): capacity, reject vs wait, FIFO order, cancelled waiters."""
from __future__ import annotations

import asyncio

import pytest

from specdec.server.admission import Admission, QueueFull


def test_reject_policy_raises_when_full_and_recovers():
    async def main():
        a = Admission(capacity=4, policy="reject")
        await a.acquire(3)
        with pytest.raises(QueueFull):
            await a.acquire(2)
        await a.acquire(1)
        a.release(3)
        await a.acquire(2)
        assert a.num_in_use == 3
        with pytest.raises(ValueError, match="capacity of 4"):
            await a.acquire(5)

    asyncio.run(main())


def test_wait_policy_is_fifo_and_skips_cancelled_waiters():
    async def main():
        a = Admission(capacity=2, policy="wait")
        order = []
        await a.acquire(2)

        async def waiter(name, k):
            await a.acquire(k)
            order.append(name)

        big = asyncio.create_task(waiter("big", 2))
        await asyncio.sleep(0)
        gone = asyncio.create_task(waiter("gone", 1))
        small = asyncio.create_task(waiter("small", 1))
        await asyncio.sleep(0)
        assert not a.can_acquire(1)  # waiters queue: no overtaking
        gone.cancel()
        await asyncio.sleep(0)
        a.release(2)
        await asyncio.sleep(0)
        assert order == ["big"] and a.num_in_use == 2  # FIFO: small waits behind big
        a.release(2)
        await asyncio.wait_for(small, 1)
        assert order == ["big", "small"] and a.num_in_use == 1
        assert big.done() and gone.cancelled()

    asyncio.run(main())
