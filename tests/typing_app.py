"""A user's app as their type checker sees it: tests/test_typing.py runs mypy on this file
(never imported by the suite; nothing here runs). Each `reveal_type` line and each
`# E:` comment is an expectation that test checks."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from datetime import datetime, timezone
from typing import Any

import forkq
import forkq.api
import forkq.limiter
import forkq.testing


@forkq.job
def send_welcome(user_id: int, *, locale: str = "en") -> bool:
    return user_id > 0


@forkq.job(queue="mail", retry=5, keep_result=3600)
def render(template: str, count: int = 1) -> str:
    return template * count


@forkq.job(iterable=True)
def export(table: str, cursor: int | None = None) -> Iterator[int]:
    yield from range(cursor or 0, 10)


@forkq.job
async def fetch(url: str) -> bytes:
    await asyncio.sleep(0)
    return url.encode()


@send_welcome.retry_in
def backoff(count: int, exc: BaseException) -> float | str | None:
    return "kill" if isinstance(exc, KeyError) else 10.0 * (count + 1)


@send_welcome.retries_exhausted
def gave_up(job: dict[str, Any], exc: BaseException) -> None:
    print(job["jid"], exc)


payments = forkq.limiter.concurrent("payments", 5)


@forkq.job(time_limit=30, unique_for=600)
def charge(order_id: int) -> None:
    job = forkq.current_job()
    if job is not None:
        print(job["jid"])
    forkq.progress(1, 2, note="charging")
    with payments.acquire():
        pass


@forkq.job()
def ping() -> None: ...


def push_any(job: forkq.Job[..., Any], *args: Any) -> str | None:
    """A helper over any job: the call is checked at run time only."""
    return job.options(queue="low").enqueue(*args)


def good_calls(client: forkq.Client) -> None:
    jid: str | None = send_welcome.enqueue(42)
    send_welcome.enqueue(42, locale="fr")
    send_welcome.enqueue_in(30, 42)
    send_welcome.enqueue_at(datetime.now(timezone.utc), 42, locale="de")
    send_welcome.enqueue_at(1.7e9, 42)
    jids: list[str] = render.enqueue_many([("a",), ("b", 2), forkq.call("c", count=3)])
    render.options(queue="low", retry=0).enqueue("x", 2)
    render.options(client=client).enqueue_in(1.5, "x")
    export.enqueue("users")
    ping.enqueue()
    push_any(render, "x", 2)
    ok: bool = send_welcome(1)
    text: str = render("x", 2)
    reveal_type(send_welcome)  # R: forkq.jobs.Job[[user_id: int, *, locale: str =], bool]
    reveal_type(send_welcome.enqueue(1))  # R: str | None
    reveal_type(render.options(queue="low"))  # R: forkq.jobs.Enqueuer[[template: str, count: int =]]
    # calling an async def job returns its coroutine, as calling the function does
    coro: Coroutine[Any, Any, bytes] = fetch("u")
    coro.close()

    # the client and the rest of the API
    other = forkq.Client("redis://localhost:6399/0")
    pushed: str | None = other.push("Mailer", [1, "x"], queue="mail", kwargs={"a": 1})
    many: list[str] = other.push_bulk("Mailer", [[1], [2]])
    value: Any = forkq.result(jid or "", timeout=5.0, client=other)
    chained: list[str] = forkq.chain(render.call("a"), send_welcome.call(1)).enqueue()
    with forkq.Batch("import", client=other) as b:
        b.on_success(send_welcome, 1)
        b.on_complete(render.options(queue="low"), "done", count=2)
        render.enqueue("in a batch")
    status: forkq.BatchStatus | None = forkq.batch_status(b.bid, client=other)
    forkq.periodic("*/5 * * * *", render, ["tick"], tz="Europe/Paris")
    forkq.periodic("@daily", "Ruby::Nightly", name="nightly")
    with forkq.testing.fake() as jobs:
        send_welcome.enqueue(3)
        calls: list[list[Any]] = jobs.args(send_welcome)
        jobs.drain()
    with forkq.testing.inline():
        render.enqueue("now")
    conn = forkq.api.connect("redis://localhost:6399/0")
    sizes: list[forkq.api.QueueInfo] = forkq.api.queues(conn)
    dead: int = forkq.api.dead(conn).size()
    forkq.api.pause(conn, "mail", reason="maintenance")
    outcome = forkq.api.cancel(conn, jid or "", reason="duplicate")
    print(outcome)
    print(jid, jids, ok, text, pushed, many, value, chained, status, calls, sizes, dead)


def bad_calls() -> None:
    send_welcome.enqueue("42")  # E: arg-type
    send_welcome.enqueue(42, locale=1)  # E: arg-type
    send_welcome.enqueue(42, lang="fr")  # E: call-arg
    send_welcome.enqueue_in("soon", 42)  # E: arg-type
    render.enqueue()  # E: call-arg
    render.options(queue="low").enqueue("x", "2")  # E: arg-type
    render.enqueue_at(1.7e9, 3)  # E: arg-type
    forkq.chain(forkq.call("a"))  # E: arg-type
    forkq.Batch().on_success(send_welcome, "1")  # E: arg-type
    forkq.periodic("* * * * *", render.call("x"))  # E: arg-type
    send_welcome("1")  # E: arg-type
    jid: int = send_welcome.enqueue(1)  # E: assignment
    print(jid)
