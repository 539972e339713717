"""Review of queue management (api.Queue delete/apply/clear, forget.lua 'near',
clear_list_page.lua) and `forkq start --reload`: each test a bug found, in-process against
the redis fixture.

Jobs are laid out with LPUSH in order, so the first laid out is the next to run."""

from __future__ import annotations

import json

import pytest

from forkq import api, keys


def job(i: int, klass: str = "Mailer", **extra) -> str:
    out = {"class": klass, "args": [i], "jid": "%024x" % (i + 1), "queue": "mail", "retry": True,
           "created_at": 1700000000.5, "enqueued_at": 1700000000.5 + i}
    out.update(extra)
    return json.dumps(out)


def lay_out(r, raws: list, name: str = "mail") -> None:
    r.lpush(keys.queue(name), *raws)


def waiting(r, name: str = "mail") -> list:
    """The first argument of each waiting job, next to run first."""
    return [json.loads(raw)["args"][0] for raw in reversed(r.lrange(keys.queue(name), 0, -1))]


@pytest.mark.timeout(20)
def test_delete_finds_jobs_read_at_different_times_though_pushes_moved_them_unevenly(r, redis_url):
    """Two jobs read with 500 pushes between the reads: the first has moved 500 on, the
    second not at all. forget.lua took the first one's move as the second's too and looked
    for it only from 400 past where it was, so it stayed queued, undeleted."""
    lay_out(r, [job(i) for i in range(2000)])
    queue = api.Queue(r, "mail")
    early = queue.page(100, 1)[0]
    lay_out(r, [job(10_000 + i) for i in range(500)])
    late = queue.page(900, 1)[0]
    gone = {early.job["args"][0], late.job["args"][0]}
    assert queue.delete([early, late]) == 2
    assert waiting(r) == [i for i in range(2000) if i not in gone] + list(range(10_000, 10_500))
