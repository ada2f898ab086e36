"""Dump builds run off the serving event loop, in a thread of their own at a lower priority
(publish/schedule.py ``run_low_priority``)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import trio

from aggregator.publish import schedule


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def test_the_build_runs_in_its_own_thread_and_returns_its_value() -> None:
    loop_thread = threading.get_ident()
    seen: dict[str, object] = {}

    def build() -> int:
        seen["thread"] = threading.current_thread()
        return 42

    assert await schedule.run_low_priority(build) == 42
    thread = seen["thread"]
    assert isinstance(thread, threading.Thread)
    assert thread.ident != loop_thread and thread.daemon and thread.name == "rsagg-dumps"


async def test_a_failing_build_raises_in_the_awaiting_task() -> None:
    def build() -> None:
        raise ValueError("the package cannot be written")

    with pytest.raises(ValueError, match="cannot be written"):
        await schedule.run_low_priority(build)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
async def test_the_build_thread_is_niced_and_the_loop_thread_is_not() -> None:
    """The build's thread runs DUMP_NICE lower (up to 19); the event loop's own priority is untouched,
    and so are trio's worker threads, which the requests' state calls use."""
    before = _nice()
    niced = await schedule.run_low_priority(_nice)
    assert niced == min(19, before + schedule.DUMP_NICE)
    assert _nice() == before
    assert await trio.to_thread.run_sync(_nice) == before


async def test_the_event_loop_runs_while_a_build_blocks() -> None:
    """The build waits for something only the event loop does: it can finish only if the loop runs."""
    go = threading.Event()

    def build() -> bool:
        return go.wait(timeout=60)

    async with trio.open_nursery() as nursery:

        async def loop_task() -> None:
            await trio.sleep(0)
            go.set()

        nursery.start_soon(loop_task)
        assert await schedule.run_low_priority(build) is True


async def test_a_cancelled_wait_abandons_the_build() -> None:
    """A stop does not wait for a long build: the await ends at once, the daemon thread goes on."""
    release = threading.Event()
    started = threading.Event()

    def build() -> None:
        started.set()
        release.wait(timeout=60)

    with trio.move_on_after(60) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(schedule.run_low_priority, build)
            await trio.to_thread.run_sync(started.wait, 60)
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught  # ended by the cancel, not the bound
    release.set()
