"""`async def` jobs: one event loop per worker process, shared by every processor thread.

The loop runs in a daemon thread of its own ("forkq-asyncio"), started by the first async
job a process runs: never in a master before it forks (a loop does not survive fork), and
a child forked from a process that had one starts its own. A processor thread running an
async job hands its coroutine to the loop and waits for it, so async jobs run at most
--concurrency at a time, as sync ones do, and an app can keep one async client per process.

The coroutine runs in a copy of the processor thread's context (contextvars): structlog's
bound fields, an open batch, and forkq.current_job() (kept for it in _TASK_JOB, since the
processor's own record of its job is a thread-local) are what a sync job sees. A task
the job started and left running is in no job once the job ended, as a thread would be.

Imported only once an async job is registered.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import io
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from . import logs
from .errors import JobCancelled, TimeLimitExceeded
from .timelimit import WATCHDOG

log = logs.get("forkq.aio")

# How often a thread waiting for a coroutine under a time limit comes back to Python code,
# where the watchdog's TimeLimitExceeded can land: a wait on a lock is one C call, which
# that exception cannot interrupt. Jobs without a limit wait in one call.
POLL_S = 0.05

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_stale: list[asyncio.AbstractEventLoop] = []
# the job a coroutine runs, for logs.current_job() in the loop's thread
_TASK_JOB = logs.TASK_JOB
# processor thread ident -> the run it waits for: what an operator's cancel stops (cancel_run)
_runs: dict[int, "_Run"] = {}


def _forget_after_fork() -> None:
    """In a forked child: the parent's loop is not running here (its thread was not
    copied), and its selector is the parent's. Kept referenced, never closed nor used."""
    global _lock, _loop, _thread
    if _loop is not None:
        _stale.append(_loop)
        if threading.current_thread() is _thread:
            _end_copy(_loop)
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _loop = _thread = None


def _end_copy(copied: asyncio.AbstractEventLoop) -> None:
    """Job code forked in a coroutine: this copy of the worker has only the loop's thread,
    which would run on for good (and run other jobs' coroutines a second time). It ends
    as soon as the coroutine gives the loop control back, before any other callback, as a
    copy forked by a sync job ends with its job; a copy that exits by itself never gets
    there. (Asyncio no longer works here anyway: it refuses a loop of another process.)"""
    from .processor import _leave_copy
    ready = getattr(copied, "_ready", None)  # the loop's run queue (a deque in CPython)
    handle = asyncio.Handle(_leave_copy, (None,), copied)
    if ready is not None:
        ready.appendleft(handle)
    else:
        copied.call_soon(_leave_copy, None)


os.register_at_fork(after_in_child=_forget_after_fork)


def loop() -> asyncio.AbstractEventLoop:
    """This process's loop for async jobs, started on first use."""
    current = _loop
    if current is not None:
        return current
    with _lock:
        if _loop is None:
            _start()
        return _loop  # type: ignore[return-value]


def _start() -> None:
    global _loop, _thread
    new = asyncio.new_event_loop()
    thread = threading.Thread(target=_serve, args=(new,), name="forkq-asyncio", daemon=True)
    thread.start()
    _loop, _thread = new, thread


def _serve(new: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(new)
    try:
        while True:
            try:
                new.run_forever()
                return  # stopped by shutdown()
            except (SystemExit, KeyboardInterrupt):
                # raised by a job's coroutine: asyncio has made it that task's outcome
                # (its processor thread fails the job with it, as a sync job's), then
                # lets it out of the loop, which would end this thread and leave every
                # async job after it waiting for good
                continue
    finally:
        if not new.is_running():
            new.close()


class _Run:
    """One async job's run, shared by its processor thread and the loop's."""

    __slots__ = ("coro", "done", "task", "abandoned", "cancelled", "stopping")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.done = threading.Lock()
        self.done.acquire()  # released by the loop once the task ended (or never started)
        self.task: asyncio.Task[Any] | None = None
        self.abandoned = False
        self.cancelled = False  # by an operator (cancel_run), before it ended
        # set by cancel_run before it looks for the loop: one that came while the loop was
        # still starting is acted on when the run reaches it
        self.stopping = False

    def start(self) -> None:
        """In the loop's thread, in the job's context."""
        if self.stopping:
            self.stop()
        if self.abandoned:  # cancelled before the loop got to it
            return
        self.task = asyncio.get_running_loop().create_task(self.coro)
        self.task.add_done_callback(self._ended)

    def _ended(self, _task: asyncio.Task[Any]) -> None:
        self.done.release()

    def stop(self) -> None:
        """In the loop's thread: an operator's cancel. The job ends as cancelled only if
        this came before its task ended (the loop runs one or the other first)."""
        if self.task is None or not self.task.done():
            self.cancelled = True
            self.cancel()

    def cancel(self) -> None:
        """In the loop's thread."""
        if self.task is not None:
            self.task.cancel()
            return
        # never started (the processor was interrupted before its submission reached the
        # loop): nothing will run it
        if self.abandoned:  # a cancel and a stop both came first: done is released once
            return
        self.abandoned = True
        self.coro.close()
        self.done.release()


def runner(fn: Callable[..., Any], limited: bool) -> Callable[..., Any]:
    """What a worker calls for the async def `fn`: a plain function that runs its
    coroutine on this process's loop and returns its result or raises its exception.
    `fn` may be a decorator's plain wrapper around an async def: what it returns is the
    result when it is no coroutine (a wrapper that ran the coroutine itself)."""

    @functools.wraps(fn)
    def run_async(*args: Any, **kwargs: Any) -> Any:
        coro = fn(*args, **kwargs)
        return run(coro, limited) if asyncio.iscoroutine(coro) else coro

    run_async.__wrapped__ = fn  # type: ignore[attr-defined]
    return run_async


def run(coro: Coroutine[Any, Any, Any], limited: bool = False) -> Any:
    """Run `coro` on this process's loop in a copy of this thread's context; wait for it."""
    if asyncio._get_running_loop() is not None:
        coro.close()
        raise RuntimeError(
            "an async job was run from inside a running event loop (an async test, or a "
            "coroutine pushing a job under forkq.testing.inline()): forkq would block that "
            "loop waiting for the job. Push it under forkq.testing.fake() and call "
            "jobs.drain() outside the loop, or await the job's function directly")
    running = [getattr(logs._job, "current", None)]
    job = _Run(coro)
    ident = threading.get_ident()
    # Before the loop may be started: from here an operator's cancel goes through the run
    # (cancel_run), never raised in this thread, where it could land in the loop's start-up
    # (threading's own code, under _lock) and leave a loop thread nobody uses, or this
    # thread waiting for good with _lock held.
    _runs[ident] = job
    try:
        target = loop()
        ctx = contextvars.copy_context()
        ctx.run(_TASK_JOB.set, running)
        try:
            # from here an interruption always reaches job.cancel, after job.start if that
            # was queued: the loop runs callbacks in order
            target.call_soon_threadsafe(job.start, context=ctx)
            if limited:
                while not job.done.acquire(timeout=POLL_S):
                    pass
            else:
                job.done.acquire()
        except BaseException as exc:
            # a time limit (or a test's Ctrl-C) landed while the coroutine ran: cancel it
            # and let it finish cancelling, as a sync job's finally blocks would run
            try:
                target.call_soon_threadsafe(job.cancel)
            except RuntimeError:  # the loop is closed: nothing runs there any more
                raise exc from None
            _await_cancelled(job, exc)
            raise
        task = job.task
        if job.cancelled and (task is None or task.cancelled() or task.exception() is not None):
            # an operator's cancel: the job ends as JobCancelled, not with the CancelledError
            # (or whatever the coroutine made of it) that stopped its task. One that caught
            # it and returned is done, as a sync job that catches JobCancelled and returns
            # is: its work finished, and a retry from dead would run it again.
            raise JobCancelled
        assert task is not None
        return task.result()
    finally:
        _runs.pop(ident, None)
        running[0] = None  # a task the job left running is in no job from now on


def cancel_run(ident: int) -> bool:
    """An operator cancelled the job thread `ident` runs (timelimit.Watchdog.cancel): if it
    waits for a coroutine, cancel that coroutine's task on the loop, and True. The thread
    may be blocked in one C wait, which an exception raised in it could not interrupt."""
    job = _runs.get(ident)
    if job is None:
        return False
    job.stopping = True  # before the loop is read: see run()
    target = _loop
    if target is None:  # the thread is starting the loop: job.start finds `stopping` set
        return True
    try:
        target.call_soon_threadsafe(job.stop)
    except RuntimeError:  # the loop is closed: raise in the thread instead
        return False
    return True


def _await_cancelled(job: _Run, exc: BaseException) -> None:
    """Wait for a cancelled coroutine to end, for half of --time-limit-grace at most: one
    that swallows its CancelledError (or blocks the loop) is left running, and the job
    fails without it. Half: well before the watchdog would give up this thread, which it
    would take for stuck in a call."""
    wait = WATCHDOG.grace / 2
    if job.done.acquire(timeout=wait):
        task = job.task
        if task is not None and not task.cancelled():
            task.exception()  # read: asyncio would log it as never retrieved
        return
    stack = io.StringIO()
    task = job.task
    if task is not None:
        task.print_stack(file=stack)
    log.error(f"an async job did not end within {wait:g} s of its cancellation; it is left "
              "running on the event loop, and the job fails", error=type(exc).__name__,
              stack=stack.getvalue())
    if isinstance(exc, TimeLimitExceeded) and not exc.args:
        exc.args = (f"the job ran longer than its time limit, and its coroutine had not ended "
                    f"{wait:g} s after its cancellation; left running",)


def shutdown(timeout: float = 1.0) -> None:
    """At a worker's stop, once its jobs ended: cancel what is left on the loop (tasks the
    jobs started and left behind), give them `timeout` to finish, and stop the loop. The
    thread is a daemon: a task that will not end does not hold the exit."""
    global _loop, _thread
    with _lock:
        current, thread = _loop, _thread
        _loop = _thread = None
    if current is None or thread is None:
        return

    async def finish() -> None:
        here = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not here]
        for t in left:
            t.cancel()
        if left:
            _, pending = await asyncio.wait(left, timeout=timeout)
            if pending:
                log.warning("tasks left on the event loop did not end when cancelled at stop",
                            tasks=len(pending))
        current.stop()

    started = time.monotonic()
    try:
        current.call_soon_threadsafe(lambda: current.create_task(finish()))
    except RuntimeError:  # closed already
        return
    thread.join(max(0.0, timeout + 0.5 - (time.monotonic() - started)))

