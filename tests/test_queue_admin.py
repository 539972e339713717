"""Managing a queue's waiting jobs: api.Queue's entries/apply/delete/clear, `forkq queue NAME
list|delete`, and the queue page's "Delete all". In-process against the redis fixture (the
CLI through cli.main), one `forkq web` subprocess for the button.

Jobs are laid out with LPUSH in order, so the first laid out is the next to run (workers
RPOP the right end), as pushes leave them.
"""

from __future__ import annotations

import json
import random
import threading

import pytest

import forkq
from forkq import api, cli, keys
from webkit import Client, WebServer


@forkq.job(queue="reports", name="queue_admin_test.report")
def report(what):
    pass


def job(i: int, klass: str = "Mailer", **extra) -> dict:
    out = {"class": klass, "args": [i], "jid": "%024x" % (i + 1), "queue": "mail", "retry": True,
           "created_at": 1700000000.5, "enqueued_at": 1700000000.5 + i}
    out.update(extra)
    return out


def lay_out(r, jobs: list, name: str = "mail") -> None:
    """LPUSH in order: jobs[0] runs next."""
    raws = [j if isinstance(j, (bytes, str)) else json.dumps(j) for j in jobs]
    for i in range(0, len(raws), 10_000):
        r.lpush(keys.queue(name), *raws[i:i + 10_000])


def waiting(r, name: str = "mail") -> list:
    """The queue's jobs' first arguments (or raw bytes), next to run first."""
    out = []
    for raw in reversed(r.lrange(keys.queue(name), 0, -1)):
        try:
            out.append(json.loads(raw)["args"][0])
        except ValueError:
            out.append(raw)
    return out


def stat_calls(r, command: str) -> int:
    return r.info("commandstats").get(f"cmdstat_{command}", {"calls": 0})["calls"]


@pytest.mark.timeout(30)
def test_entries_list_next_to_run_first_and_filter(r, redis_url, capsys):
    lay_out(r, [job(i, "A" if i % 2 else "B") for i in range(12)] + [b"not json"])
    queue = api.Queue(r, "mail", page_size=5)
    seen = list(queue.entries())
    assert [e.job["args"][0] for e in seen[:12]] == list(range(12)) and seen[12].job is None
    assert [e.position for e in seen] == list(range(13))
    newest = list(queue.entries(next_first=False))
    assert newest[0].job is None and [e.job["args"][0] for e in newest[1:]] == list(range(11, -1, -1))
    assert [e.jid for e in queue.entries(api.matching(klass="A"))] == ["%024x" % (i + 1) for i in range(1, 12, 2)]
    assert queue.find("%024x" % 8).position == 7 and queue.find("f" * 24) is None

    assert cli.main(["queue", "mail", "list", "--class", "A", "--limit", "2", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["position"], e["class"], e["job"]["args"]) for e in listed] == [(1, "A", [1]), (3, "A", [3])]
    assert cli.main(["queue", "mail", "list", "--jid", "%024x" % 5]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["position", "enqueued", "(UTC)", "jid", "class", "args"]
    assert row.split()[0] == "4" and "%024x" % 5 in row
    assert cli.main(["queue", "mail", "list", "--limit", "20"]) == 0
    assert "(unparseable entry)" in capsys.readouterr().out.splitlines()[-1]
    assert cli.main(["queue", "nothing-here", "list"]) == 0
    assert capsys.readouterr().out == "no matching jobs wait on queue nothing-here\n"


@pytest.mark.timeout(30)
def test_delete_by_class_leaves_the_others_in_order_while_pushes_and_pops_move_them(r, redis_url):
    """3,000 jobs, every third a Bad one, deleted in pages of 100 while, before each delete,
    50 jobs are pushed at the newest end and a worker pops 3 at the other: the jobs move
    from where they were read, and are found and removed all the same."""
    lay_out(r, [job(i, "Bad" if i % 3 == 0 else "Mailer") for i in range(3000)])
    queue = api.Queue(r, "mail", page_size=100)
    popped: list = []
    pushed = iter(range(10_000, 20_000))
    delete = queue.delete

    def delete_meanwhile(entries):
        r.lpush(keys.queue("mail"), *[json.dumps(job(next(pushed), "Late")) for _ in range(50)])
        popped.extend(json.loads(raw)["args"][0] for raw in r.rpop(keys.queue("mail"), 3))
        return delete(entries)

    r.config_resetstat()
    removed = queue.apply(delete_meanwhile, api.matching(klass="Bad"))
    left = waiting(r)
    bad_popped = [i for i in popped if i < 3000 and i % 3 == 0]
    assert removed == 1000 - len(bad_popped)
    assert [i for i in left if i < 3000] == [i for i in range(3000) if i % 3 and i not in popped]
    assert [i for i in left if i >= 10_000] == [i for i in range(10_000, 10_000 + len(left) - len(
        [i for i in left if i < 3000]))]
    # one LREM a gathered page of matches (30 pages, 1,000 matches), not one a job
    assert stat_calls(r, "lrem") <= 12


def mixed_queue(r, client, n: int) -> tuple[list[str], list[str], forkq.Batch]:
    """n jobs on mail, a third each plain, unique (their locks held) and in one batch, in
    random order; returns the unique jids, the batch's jids and the batch."""
    third = n // 3
    with forkq.Batch(client=client).on_complete(report, "done") as group:
        in_batch = client.push_bulk("app.Part", [[i] for i in range(third)], queue="mail")
    uniques = client.push_bulk("app.Once", [[i] for i in range(third)], queue="mail", unique_for=3600)
    client.push_bulk("app.Plain", [[i] for i in range(n - 2 * third)], queue="mail")
    raws = r.lrange(keys.queue("mail"), 0, -1)
    random.Random(7).shuffle(raws)
    r.delete(keys.queue("mail"))
    lay_out(r, raws)
    assert len(uniques) == third and len(in_batch) == third and r.llen(keys.queue("mail")) == n
    return uniques, in_batch, group


def locks(r) -> list[bytes]:
    return list(r.scan_iter("unique:*", count=10_000))


@pytest.mark.timeout(60)
def test_clear_ends_every_lock_and_batch_job_of_50000_mixed_jobs_exactly_once(r, redis_url):
    client = forkq.Client(redis_url)
    uniques, in_batch, group = mixed_queue(r, client, 50_000)
    assert len(locks(r)) == len(uniques)
    r.config_resetstat()
    assert api.Queue(r, "mail").clear() == 50_000
    assert r.llen(keys.queue("mail")) == 0 and locks(r) == []
    # each lock looked at once (unlock's GET), each batch job counted once (SISMEMBER)
    assert stat_calls(r, "get") == len(uniques) and stat_calls(r, "sismember") == len(in_batch)
    status = group.status()
    assert status.pending == len(in_batch) and {f["fate"] for f in status.failures.values()} == {"deleted"}
    assert set(status.failures) == set(in_batch) and status.complete
    assert [json.loads(raw)["args"] for raw in r.lrange(keys.queue("reports"), 0, -1)] == [["done"]]
    assert api.Queue(r, "mail").clear() == 0


@pytest.mark.timeout(60)
def test_a_clear_racing_a_worker_and_a_producer_loses_nothing_and_ends_nothing_twice(r, redis_url,
                                                                                     monkeypatch,
                                                                                     redis_server):
    """While the clear runs (pages of 50), a worker pops jobs one at a time and a producer
    pushes unique jobs. Every job ends up deleted and ended, taken by the worker, or still
    queued: counted once, with its lock held unless it was deleted."""
    monkeypatch.setattr(api, "CLEAR_PAGE", 50)
    client = forkq.Client(redis_url)
    uniques, in_batch, group = mixed_queue(r, client, 3000)
    stop = threading.Event()
    taken: list[str] = []
    pushed: list[str] = []

    def work():
        conn = redis_server.client()
        while not stop.is_set():
            raw = conn.rpop(keys.queue("mail"))
            if raw is not None:
                taken.append(json.loads(raw)["jid"])

    def produce():
        c = forkq.Client(redis_url)
        while not stop.is_set() and len(pushed) < 2000:
            pushed.extend(c.push_bulk("app.Late", [[len(pushed) + i] for i in range(5)], queue="mail",
                                      unique_for=3600))

    threads = [threading.Thread(target=work), threading.Thread(target=produce)]
    for t in threads:
        t.start()
    try:
        removed = api.Queue(r, "mail").clear()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    left = {json.loads(raw)["jid"] for raw in r.lrange(keys.queue("mail"), 0, -1)}
    everyone = set(uniques) | set(in_batch) | set(pushed)
    everything = 3000 + len(pushed)
    assert len(taken) == len(set(taken)) and not (set(taken) & left)
    assert removed == everything - len(taken) - len(left) and taken and pushed and removed > 2000
    deleted = everyone - set(taken) - left
    held = {r.get(k).decode() for k in locks(r)}
    assert held == (set(uniques) | set(pushed)) - deleted  # a lock goes with its job, only then
    assert set(group.status().failures) == set(in_batch) & deleted


@pytest.mark.timeout(30)
def test_queue_delete_commands_print_counts_and_exit_codes(r, redis_url, capsys):
    client = forkq.Client(redis_url)
    jids = client.push_bulk("app.Once", [[i] for i in range(4)], queue="mail", unique_for=3600)
    lay_out(r, [job(100 + i, "Bad") for i in range(3)])
    assert cli.main(["queue", "mail", "delete", "--class", "Bad"]) == 0
    assert capsys.readouterr().out == "delete: 3 jobs of queue mail\n"
    assert cli.main(["queue", "mail", "delete", "--jid", jids[1], "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"queue": "mail", "action": "delete", "count": 1,
                                                   "chains_cut": 0}
    assert len(locks(r)) == 3 and r.llen(keys.queue("mail")) == 3
    assert cli.main(["queue", "mail", "delete", "--jid", jids[1]]) == 1
    assert capsys.readouterr().err == f"forkq: no job with jid {jids[1]} waits on queue mail\n"
    for argv in (["queue", "mail", "delete"], ["queue", "mail", "delete", "--all", "--class", "A"],
                 ["queue", "", "list"], ["queue", "mail", "frobnicate"], ["queue", "mail", "list", "--limit", "0"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("forkq: "), argv
    assert cli.main(["queue", "bad\nname", "list"]) == 2
    assert cli.main(["queue", "mail", "delete", "--all"]) == 0
    assert capsys.readouterr().out == "delete: 3 jobs of queue mail (workers may have taken some meanwhile)\n"
    assert r.llen(keys.queue("mail")) == 0 and locks(r) == []
    assert cli.main(["queue", "mail", "delete", "--all", "--redis-url", "redis://u:hunter2@127.0.0.1:1/0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hunter2" not in err


@pytest.mark.timeout(60)
def test_the_queue_pages_delete_all_button_clears_it_behind_a_confirm_and_csrf(r, redis_url, redis_server):
    client = forkq.Client(redis_url)
    client.push_bulk("app.Once", [[i] for i in range(3)], queue="mail", unique_for=3600)
    client.push_bulk("app.Plain", [[i] for i in range(4)], queue="mail")
    with WebServer(redis_server.url) as web:
        browser = Client(web.base)
        page = browser.get("/queues/mail")
        button = page.text[page.text.index('value="delete-all"') - 200:page.text.index("Delete all</button>")]
        assert 'data-confirm="Delete: all 7 jobs of this queue?"' in button and 'class="danger"' in button
        assert browser.post("/queues/mail", {"do": "delete-all"}, csrf="").status == 403
        assert r.llen(keys.queue("mail")) == 7
        resp = browser.post("/queues/mail", {"do": "delete-all", "back": "/queues/mail?page=1"}, csrf=page.csrf)
        assert resp.status == 303 and resp.headers["Location"].endswith("/queues/mail?page=1")
        assert r.llen(keys.queue("mail")) == 0 and locks(r) == []
        assert "delete: 7 jobs (workers may have taken some meanwhile)" in browser.get("/queues/mail").text
