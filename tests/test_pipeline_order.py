"""The pipeline's results reach the commit task in input order, a full batch at a time
(``pipeline._InOrder``): for generated arrival orders, batch sizes and numbers of senders, the batches
are exactly the results in ``seq`` order cut every ``batch_size``, a result is never released before
all those ahead of it, and the rest comes at the end."""

from __future__ import annotations

import math
import random

import trio

from aggregator.harvest import pipeline
from aggregator.rs.model import Entry


def _result(seq: int) -> pipeline._Result:
    return pipeline._Result(pipeline.Work(Entry(loc=f"http://example.org/{seq}")), None)


async def test_results_are_released_in_order_in_full_batches() -> None:
    rng = random.Random(28)
    for _ in range(200):
        n = rng.randint(0, 120)
        size = rng.choice([1, 2, 3, 7, 50, 1000])
        senders = rng.randint(1, 5)
        # arrival: each result late by a random amount, so gaps open and close
        arrival = sorted(range(n), key=lambda seq: seq + rng.randint(0, rng.choice([0, 3, 40])))
        results = {seq: _result(seq) for seq in range(n)}
        send, recv = trio.open_memory_channel[list[pipeline._Result]](math.inf)
        order = pipeline._Order(size)
        root = pipeline._InOrder(send, order)
        clones = [root.clone() for _ in range(senders)]
        root.close()
        got: list[list[pipeline._Result]] = []
        released = 0
        for i, seq in enumerate(arrival):
            clones[i % senders].send_nowait((seq, results[seq]))
            while True:
                try:
                    batch = recv.receive_nowait()
                except trio.WouldBlock:
                    break
                got.append(batch)
                released += len(batch)
            # nothing is released before every result ahead of it arrived
            arrived = set(arrival[: i + 1])
            assert all(s in arrived for s in range(released))
        for clone in clones:
            clone.close()
        async with recv:
            assert [b async for b in recv] == []  # closed once every sender is
        assert all(len(b) == size for b in got)
        got.append(order.rest())
        flat = [r for b in got for r in b]
        assert flat == [results[s] for s in range(n)]
