"""A task keeping its request slot between GETs (``Fetcher.keeping_slots``): never more requests to a
host at once than its slots, every GET served, the slot handed on after ``KEEP_MOST`` GETs in a row,
and handed back before the task waits for anything else (its next item, a backoff); a paced Source
keeps nothing."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import trio

from aggregator.harvest import pipeline
from aggregator.harvest.fetch import KEEP_MOST, Fetcher, SlotKeeper
from tests.httpserver import answer_lifespan, serve_app


class Server:
    """An ASGI app answering every GET with its path; counts requests in flight per Host header (the
    most seen at once) and keeps the order in which requests arrived."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng
        self.now: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.order: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode().split(":")[0]
        self.order.append(scope["path"])
        self.now[host] += 1
        self.most[host] = max(self.most[host], self.now[host])
        try:
            for _ in range(self.rng.randrange(3) if self.rng else 0):
                await trio.sleep(0)
            body = scope["path"].encode()
            headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        finally:
            self.now[host] -= 1


async def get(fetcher: Fetcher, url: str) -> bytes:
    async with fetcher._get(url, {}, lean_ok=True) as body:
        return b"".join([c async for c in body.chunks()])


@pytest.mark.parametrize("seed", range(6))
async def test_keepers_never_exceed_a_hosts_slots_and_every_get_is_served(seed: int) -> None:
    """Generated: tasks that keep slots (their ``more`` saying yes or no at random) and tasks that do
    not, GETs to two hosts in random order, pauses between them. Never more requests in flight to a
    host than its slots; every GET answered; no slot borrowed once all are done."""
    rng = random.Random(seed)
    per_host = rng.randrange(1, 4)
    server = Server(rng)
    served: list[str] = []
    async with serve_app(server) as base:
        port = base.rsplit(":", 1)[1]
        hosts = [f"http://127.0.0.1:{port}", f"http://localhost:{port}"]
        async with Fetcher(per_host=per_host) as fetcher:

            async def task(i: int, keeps: bool) -> None:
                plan = [(rng.choice(hosts), f"/t{i}/g{j}") for j in range(rng.randrange(1, 25))]

                async def run(keeper: SlotKeeper | None) -> None:
                    for base_url, path in plan:
                        served.append((await get(fetcher, base_url + path)).decode())
                        if rng.random() < 0.2:  # waits for something else: the slot goes back first
                            if keeper is not None:
                                keeper.hand_back()
                            await trio.sleep(0)

                if keeps:
                    with fetcher.keeping_slots(lambda: rng.random() < 0.8) as keeper:
                        await run(keeper)
                else:
                    await run(None)

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for i in range(rng.randrange(2, 7)):
                        nursery.start_soon(task, i, rng.random() < 0.7)
            limiters = list(fetcher._limiters.values())
    assert sorted(served) == sorted(server.order)
    assert server.most and all(n <= per_host for n in server.most.values()), (per_host, server.most)
    assert all(lim.borrowed_tokens == 0 for lim in limiters)


async def test_a_kept_slot_changes_hands_after_keep_most_gets() -> None:
    """One slot; a task that always has more keeps it for ``KEEP_MOST`` GETs, then the waiting task's
    GET goes before its next one."""
    server = Server()
    async with serve_app(server) as base, Fetcher(per_host=1) as fetcher:
        first = trio.Event()

        async def keeper_task() -> None:
            with fetcher.keeping_slots(lambda: True):
                for j in range(KEEP_MOST * 2):
                    await get(fetcher, f"{base}/k{j}")
                    first.set()

        async def other() -> None:
            await first.wait()
            await get(fetcher, f"{base}/other")

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keeper_task)
                nursery.start_soon(other)
    at = server.order.index("/other")
    assert at == KEEP_MOST, server.order  # after the keeper's first KEEP_MOST GETs, not later


async def test_a_fetch_task_waiting_for_work_holds_no_slot() -> None:
    """``pipeline._Workers`` with ``keeping``: a fetch task keeps its slot while an item waits for it;
    when that item needs no GET (a deletion) and the task then waits for its next item, it hands the
    slot back first, so another request to the host goes at once (one slot)."""
    server = Server()
    async with serve_app(server) as base, Fetcher(per_host=1) as fetcher:
        done: list[str] = []

        async def handle(item: str) -> None:
            if item != "deletion":
                done.append((await get(fetcher, f"{base}/{item}")).decode())
            else:
                done.append(item)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                with pipeline._Workers(nursery, handle, 1, 4, keeping=fetcher.keeping_slots) as workers:
                    for item in ("a0", "a1", "deletion"):  # queued before the first GET ends
                        await workers.send(item)
                    while len(done) < 3:
                        await trio.sleep(0.01)
                    # The task waits for its next item now: the slot is free for anyone.
                    assert fetcher._limiters["127.0.0.1"].borrowed_tokens == 0
                    assert await get(fetcher, f"{base}/b") == b"/b"
                    await workers.send("a3")
        assert done == ["/a0", "/a1", "deletion", "/a3"]


async def test_a_backoff_hands_the_kept_slot_back() -> None:
    server = Server()
    async with serve_app(server) as base, Fetcher(per_host=1) as fetcher:
        with fetcher.keeping_slots(lambda: True) as keeper:
            await get(fetcher, f"{base}/x")
            assert keeper is not None and keeper.limiter is not None  # kept for the next GET
            await fetcher._sleep(0)
            assert keeper.limiter is None
            assert fetcher._limiters["127.0.0.1"].borrowed_tokens == 0


async def test_a_paced_source_keeps_no_slot() -> None:
    """A request hook that paces the current source (``Access.paces``): nothing is kept."""

    class Paced:
        async def __call__(self, request: object) -> None:
            return None

        def paces(self) -> bool:
            return True

    server = Server()
    async with serve_app(server) as base, Fetcher(per_host=1, request_hook=Paced()) as fetcher:
        with fetcher.keeping_slots(lambda: True) as keeper:
            assert keeper is None
            await get(fetcher, f"{base}/x")
            assert fetcher._limiters["127.0.0.1"].borrowed_tokens == 0
