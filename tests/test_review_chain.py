"""forkq.chain edge cases found in review: each test names what went wrong before."""

from __future__ import annotations

import json

import pytest

import forkq
from forkq import chains, testing
from corekit import hand_driven_fixture, queued, run_one

calls: list = []
returns: dict = {}


@forkq.job(queue="rq", name="review_chain.give")
def give(tag: str):
    calls.append(["give", tag])
    return returns[tag]


@forkq.job(queue="rq", name="review_chain.take")
def take(*args):
    calls.append(["take", *args])


@pytest.fixture
def client(redis_url):
    calls.clear()
    returns.clear()
    c = forkq.configure(redis_url)
    try:
        yield c
    finally:
        forkq.client._default = None


worker = hand_driven_fixture("rq", "test:1:revchain0000a")


def dead(r) -> list[dict]:
    return [json.loads(m) for m in r.zrange("dead", 0, -1)]


@pytest.mark.parametrize("value", ["\udcff", ["name", {"file": "a\udc80b"}]], ids=["str", "nested"])
def test_a_passed_value_utf8_cannot_hold_parks_the_continuation_in_dead(client, r, worker, value):
    """A lone surrogate (what os.listdir gives for a filename that is not UTF-8) passed on
    by pass_result: json wrote it, redis-py's UTF-8 encoding refused it inside the script
    call, and the step stayed in flight, to run again at every restart and fail the same
    way, its chain never going on nor reaching dead."""
    returns["x"] = value
    forkq.chain(give.call("x"), take.call(), pass_result=True).enqueue()
    run_one(worker)
    assert r.hlen(worker.fetch.inflight_key) == 0 and worker.fetch.pending_acks() == 0
    assert queued(r, "rq") == [] and calls == [["give", "x"]]
    (entry,) = dead(r)
    assert entry["error_class"] == "forkq.ChainBroken"
    assert "UTF-8 cannot carry (surrogates not allowed: '\\ud" in entry["error_message"]
    assert json.loads(entry["forkq_original"])[0]["class"] == "review_chain.take"


def test_test_modes_raise_broken_for_a_continuation_redis_could_not_take(client):
    """Under forkq.testing the same value went on to the next step (fake, inline), and an
    integer past json's 4,300 digits raised a bare ValueError, where the README promises
    forkq.chains.Broken, the worker's reason for dead."""
    returns.update(sur="\udcff", big=10 ** 5000)
    for tag, why in (("sur", "UTF-8 cannot carry"), ("big", "4300 digits")):
        with testing.fake() as jobs:
            forkq.chain(give.call(tag), take.call(), pass_result=True).enqueue()
            with pytest.raises(chains.Broken, match=why):
                jobs.drain()
        with testing.inline(), pytest.raises(chains.Broken, match=why):
            forkq.chain(give.call(tag), take.call(), pass_result=True).enqueue()
    assert [c for c in calls if c[0] == "take"] == []
