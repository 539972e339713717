"""The in-process handoff from the fetcher to the processor threads (manager.Handoff)."""

from __future__ import annotations

import threading

import pytest
from helpers import wait_until

from forkq.fetch import Unit
from forkq.manager import Handoff


def _threads(handoff: Handoff, n: int, run) -> list[threading.Thread]:
    def loop() -> None:
        bell = threading.Lock()
        bell.acquire()
        while (unit := handoff.get(bell)) is not None:
            run(unit)
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.timeout(30)
def test_blocking_jobs_put_together_run_side_by_side() -> None:
    """One put wakes one thread, but jobs that block must still all run at once: each
    waits at a barrier that only opens when all ten are inside a job."""
    handoff = Handoff()
    barrier = threading.Barrier(10, timeout=10)
    passed = []
    threads = _threads(handoff, 10, lambda unit: passed.append(barrier.wait()))
    for round_ in range(1, 4):  # the threads are asleep again between rounds
        handoff.put_many([Unit(str(i), "q", b"{}") for i in range(10)])
        wait_until(lambda: len(passed) == 10 * round_, message="ten jobs side by side")
    handoff.put_many([None] * 10)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(passed) == 30  # a broken barrier would have raised in a thread instead


@pytest.mark.timeout(30)
def test_every_unit_is_taken_exactly_once_and_none_stops_every_thread() -> None:
    handoff = Handoff()
    taken: list[str] = []
    lock = threading.Lock()

    def run(unit: Unit) -> None:
        with lock:
            taken.append(unit.token)
    threads = _threads(handoff, 7, run)
    for start in range(0, 5000, 50):
        handoff.put_many([Unit(str(i), "q", b"{}") for i in range(start, start + 50)])
    handoff.put_many([None] * 7)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert sorted(taken, key=int) == [str(i) for i in range(5000)]
    assert handoff.drain() == []


@pytest.mark.timeout(30)
def test_drain_returns_what_no_thread_took_in_order() -> None:
    handoff = Handoff()
    units = [Unit(str(i), "q", b"{}") for i in range(5)]
    handoff.put_many(units)
    assert handoff.drain() == units
    assert handoff.drain() == []


@pytest.mark.timeout(30)
def test_blocking_jobs_a_processor_put_lazily_still_run_side_by_side() -> None:
    """A processor that claimed keeps one job and puts the rest lazily (waking nobody
    while a watch is kept). If its own job blocks, the others must still all start: ten
    jobs, one on the claimer, nine on the other threads, meet at one barrier."""
    handoff = Handoff()
    barrier = threading.Barrier(10, timeout=10)
    passed = []
    threads = _threads(handoff, 9, lambda unit: passed.append(barrier.wait()))
    for round_ in range(1, 6):
        units = [Unit(str(i), "q", b"{}") for i in range(10)]
        handoff.put_many(units[1:], lazy=True)
        passed.append(barrier.wait())  # the claimer runs its own job, which blocks
        wait_until(lambda: len(passed) == 10 * round_, message="ten jobs side by side")
    handoff.put_many([None] * 9)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.timeout(30)
def test_the_watch_takes_what_a_lazy_put_left_and_ends_when_puts_stop() -> None:
    handoff = Handoff(watch=0.3)  # long enough for this thread to act within one watch
    taken: list[str] = []
    threads = _threads(handoff, 3, lambda unit: unit.token != "bait" and taken.append(unit.token))

    def bait() -> bool:
        # a thread woken for nothing takes the watch: wake one, and take its job first
        # (the woken thread may still win: then try again)
        handoff.put_many([Unit("bait", "q", b"{}")])
        handoff.try_get()
        return wait_until(lambda: handoff._watcher is not None or not handoff._waking,
                          message="the woken thread came") and handoff._watcher is not None
    wait_until(bait, message="a watch kept")
    # a lazy put wakes nobody while the watch is kept; the watch still takes the job
    handoff.put_many([Unit("left", "q", b"{}")], lazy=True)
    assert not handoff._waking
    wait_until(lambda: taken == ["left"], message="the watch took the job")
    # with no more puts the watch ends, so an idle process sleeps untimed
    wait_until(lambda: handoff._watcher is None, message="the watch ended")
    # and with no watch, a lazy put wakes a thread as any put does
    handoff.put_many([Unit("late", "q", b"{}")], lazy=True)
    assert handoff._waking or taken == ["left", "late"]
    wait_until(lambda: taken == ["left", "late"], message="a woken thread took the job")
    handoff.put_many([None] * 3)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
