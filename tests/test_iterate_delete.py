"""An iterable job deleted through forkq's own paths (forkq.api, so `forkq dead|retry|schedule
delete`, `forkq queue NAME delete` and the dashboard) takes its checkpoint (forkq:iter:JID)
with it, rather than leaving it for its 30-day TTL; an entry the call did not remove (a
worker took it meanwhile) keeps its own. In-process, against the shared Redis."""

from __future__ import annotations

import json
import time

import pytest

from forkq import api, iterate, payload

QUEUE = "itdel"


def entry(jid: str, *args) -> bytes:
    return payload.dumps({"class": "it.x", "queue": QUEUE, "args": list(args), "jid": jid,
                          "created_at": time.time(), "error_class": "ValueError"}).encode()


def point(r, jid: str) -> None:
    r.set(iterate.PREFIX + jid, iterate._dump(7, "it.x"), ex=iterate.TTL_S)


def points(r) -> set[str]:
    return {k.decode()[len(iterate.PREFIX):] for k in r.keys(iterate.PREFIX + "*")}


@pytest.mark.timeout(10)
def test_deleting_set_entries_deletes_their_checkpoints_and_only_theirs(r):
    # "live" runs elsewhere: only named in another job's args, before that job's own jid
    for jid in ("it1", "it2", "it3", "live", "taken"):
        point(r, jid)
    dead = api.dead(r)
    raws = [entry("it1"), entry("it2"), entry("plain"), entry("watcher", {"jid": "live"}), entry("it3")]
    r.zadd("dead", {raw: i for i, raw in enumerate(raws)})

    assert dead.delete([dead.find("it1")]) == 1
    # one a worker (or another operator) took meanwhile: not removed here, its checkpoint stays
    assert dead.delete([api.Entry.of(entry("taken"), 0.0)]) == 0
    assert points(r) == {"it2", "it3", "live", "taken"}
    # by a filter, as `forkq dead delete --class ...` and `--all` do
    assert dead.apply(dead.delete, lambda e: e.jid == "it3") == 1
    assert points(r) == {"it2", "live", "taken"}
    # the dashboard's "Delete all": pages a script empties, checkpoints found by the text
    assert dead.clear() == 3 and r.zcard("dead") == 0
    assert points(r) == {"live", "taken"}


@pytest.mark.timeout(10)
def test_deleting_queued_jobs_deletes_their_checkpoints(r):
    """An interrupted iterable job waits on its queue with its checkpoint: `forkq queue NAME
    delete` (by jid, by class) and the dashboard's "Delete all" take it along."""
    for jid in ("q1", "q2", "q3", "live"):
        point(r, jid)
    queue = api.Queue(r, QUEUE)
    r.lpush(f"queue:{QUEUE}", entry("q1"), entry("plain"), entry("q2"), entry("w", {"jid": "live"}),
            entry("q3"))
    assert queue.delete([queue.find("q1")]) == 1
    assert points(r) == {"q2", "q3", "live"}
    assert queue.clear() == 4 and r.llen(f"queue:{QUEUE}") == 0
    assert points(r) == {"live"}


@pytest.mark.timeout(10)
def test_a_delete_all_finds_the_checkpoint_whatever_jid_the_args_name_first(r):
    """The text is searched for the job's jid, and the args come before it (as Sidekiq and
    forkq write a payload): a dict among them with a "jid" key of a job without a checkpoint
    hid the job's own, dropped with its entry and left for the 30-day TTL. Also a payload
    written with spaces (`json.dumps`' default, a hand-written push), kept as written, and
    one whose jid is written with an escape (PHP escapes its slashes)."""
    for jid in ("s1", "s2", "s/3", "q1", "q2"):
        point(r, jid)
    spaced = json.dumps({"class": "it.x", "queue": QUEUE, "args": [], "jid": "s2"}).encode()
    escaped = b'{"class":"it.x","queue":"itdel","args":[],"jid":"s\\/3"}'
    r.zadd("dead", {entry("s1", {"jid": "gone"}): 1, spaced: 2, escaped: 3,
                    entry("plain", {"jid": "none"}): 4})
    assert api.dead(r).clear() == 4 and r.zcard("dead") == 0
    queue = api.Queue(r, QUEUE)
    spaced = json.dumps({"class": "it.x", "queue": QUEUE, "args": [], "jid": "q2"}).encode()
    r.lpush(f"queue:{QUEUE}", entry("q1", {"jid": "gone"}), spaced, entry("plain", {"jid": "none"}))
    assert queue.clear() == 3 and r.llen(f"queue:{QUEUE}") == 0
    assert points(r) == set()
