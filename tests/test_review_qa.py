"""Review of queue management (api.Queue delete/apply/clear, forget.lua 'near',
clear_list_page.lua) and `forkq start --reload`: each test a bug found, in-process against
the redis fixture.

Jobs are laid out with LPUSH in order, so the first laid out is the next to run."""

from __future__ import annotations

import json

import pytest

from forkq import api, keys, scripts


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


def script_usec(r) -> int:
    """Microseconds Redis spent in script calls since the last CONFIG RESETSTAT."""
    stats = r.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {"usec": 0})["usec"] for c in ("eval", "evalsha"))


def big_queue(r, n: int, bad_every: int = 0) -> None:
    """n jobs of 40 KB each (an argument a Rails app might pass): 60 MB at n = 1,500."""
    pad = "x" * 40_000
    raws = [job(i, "Bad" if bad_every and i % bad_every == 0 else "Mailer", pad=pad)
            for i in range(n)]
    for i in range(0, n, 500):
        lay_out(r, raws[i:i + 500])


@pytest.mark.timeout(30)
def test_deleting_a_big_job_a_worker_took_does_not_hold_redis_reading_60mb(r, redis_url):
    """A job deleted after a worker took it (the dashboard's Delete of one that just ran) is
    looked for around where it was, up to 20,000 entries: with 40 KB payloads that was one
    script call copying the whole 60 MB queue into Lua, Redis held for 0.3-0.4 s here (4 s
    for 20,000 jobs of 20 KB). The search now stops after 8 MB, as cancel's scan does."""
    big_queue(r, 1500)
    queue = api.Queue(r, "mail")
    taken = queue.page(100, 1)[0]
    assert r.lrem(keys.queue("mail"), 1, taken.raw) == 1  # a worker's claim, in effect
    r.config_resetstat()
    assert queue.delete([taken]) == 0
    assert script_usec(r) < 150_000
    assert r.llen(keys.queue("mail")) == 1499


@pytest.mark.timeout(30)
def test_deleting_every_30th_big_job_reads_the_ones_between_only_when_they_are_small(r, redis_url):
    """Matches fewer than 64 entries apart were read with one LRANGE over the whole stretch,
    the entries between copied into Lua too: deleting 50 jobs of 1,500 of 40 KB read all
    60 MB in one call. Now entries are grouped so only while the stretch is small in bytes."""
    big_queue(r, 1500, bad_every=30)
    queue = api.Queue(r, "mail")
    chosen = list(queue.entries(api.matching(klass="Bad")))
    assert len(chosen) == 50
    r.config_resetstat()
    assert queue.delete(chosen) == 50
    assert script_usec(r) < 150_000
    left = waiting(r)
    assert left == [i for i in range(1500) if i % 30]


@pytest.mark.timeout(20)
def test_deleting_one_copy_of_a_job_pushed_twice_deletes_that_copy_not_the_other(r, redis_url):
    """The same job pushed twice is two equal entries. Deleting the copy next to run after
    a push had moved it removed the first equal entry the search met, the other copy: the
    one left jumped ahead of a job it had been queued behind."""
    twice = job(100)
    lay_out(r, [twice, job(1), twice])
    queue = api.Queue(r, "mail")
    next_copy = next(iter(queue))
    assert next_copy.position == 0 and next_copy.raw == twice.encode()
    lay_out(r, [job(2)])
    assert queue.delete([next_copy]) == 1
    assert waiting(r) == [1, 100, 2]
    # the copy next to run and a job pushed after both chosen, read in one stretch once a
    # push moved them: the other copy is in that stretch, one from where the chosen was
    r.delete(keys.queue("mail"))
    lay_out(r, [twice, job(1), twice, job(0)])
    chosen = [e for e in queue.entries() if e.position == 0 or e.job["args"][0] == 0]
    assert [e.position for e in chosen] == [0, 3]
    lay_out(r, [job(4)])
    assert queue.delete(chosen) == 2
    assert waiting(r) == [1, 100, 4]


@pytest.mark.timeout(30)
def test_a_clear_of_big_jobs_holds_redis_briefly_each_call(r, redis_url):
    """clear_list_page.lua popped 1,000 jobs a call whatever their size: 600 jobs of 100 KB
    were one call copying 60 MB into Lua (0.2-0.8 s of Redis held). A call now stops once
    it took 8 MB; the clear still removes them all."""
    pad = "x" * 100_000
    lay_out(r, [job(i, pad=pad) for i in range(300)])
    lay_out(r, [job(i, pad=pad, unique_for=60) for i in range(300, 600)])
    sha = scripts.load(r, "clear_list_page").sha.encode()
    before = r.config_get("slowlog-*")
    # every command logged: how many page calls it took says what each held, where a
    # timing of them says it only on a quiet machine
    r.config_set("slowlog-log-slower-than", 0)
    r.config_set("slowlog-max-len", 10_000)
    r.slowlog_reset()
    try:
        assert api.Queue(r, "mail").clear() == 600
        logged = r.slowlog_get(10_000)
    finally:
        for name, value in before.items():
            r.config_set(name, value)
    assert r.llen(keys.queue("mail")) == 0
    # the script by its sha, or by its text (its first line) when Redis had not cached it
    pages = [e for e in logged if e["command"].split(b" ")[:2] == [b"EVALSHA", sha]
             or e["command"].startswith(b"EVAL -- One step of emptying a queue")]
    # 60 MB at 8 MB a call: at least 8 calls, not one of all 600 jobs
    assert len(pages) >= 8, [e["command"][:60] for e in logged]
    assert max(e["duration"] for e in pages) < 1_000_000  # µs; 0.2-0.8 s was one call before


# -- forkq start --reload ---------------------------------------------------------------------


class _Exec(Exception):
    """os.execve, stood in for: it would replace the test process."""


@pytest.mark.timeout(10)
def test_a_stop_signal_while_the_reload_flushes_its_logs_ends_forkq_instead(monkeypatch):
    """The master looked at its self-pipe for a stop signal, then flushed its logs (a pipe
    to a slow reader can hold that for long) and exec'd: a SIGTERM or Ctrl-C meanwhile was
    written to the pipe the exec threw away, and the new master ran on. It now looks again
    with the stop signals blocked, and execs with them still blocked, so that one sent
    during the exec is pending for the new process (test below)."""
    import os
    import signal

    from forkq import logs, reload
    from forkq.settings import Settings
    from forkq.supervisor import Supervisor, _noop
    sup = Supervisor(Settings(processes=1))
    os.set_blocking(sup._sig_r, False)  # as run() leaves them
    os.set_blocking(sup._sig_w, False)
    old_fd = signal.set_wakeup_fd(sup._sig_w)
    old_term = signal.signal(signal.SIGTERM, _noop)
    masks = []

    def execve(path, argv, env):
        masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        raise _Exec

    monkeypatch.setattr(os, "execve", execve)
    try:
        sup.reloading = ["jobs.py"]
        assert sup.reload_wanted()
        monkeypatch.setattr(logs, "flush", lambda: os.kill(os.getpid(), signal.SIGTERM))
        reload.reexec(sup.stop_pending)  # returns: no exec
        assert masks == [] and sup.reloading is None
        monkeypatch.setattr(logs, "flush", lambda: None)
        with pytest.raises(_Exec):
            reload.reexec(sup.stop_pending)
        assert {signal.SIGTERM, signal.SIGINT} <= masks[0]
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # exec failed: unblocked
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGTERM, old_term)
        os.close(sup._sig_r)
        os.close(sup._sig_w)


@pytest.mark.timeout(20)
def test_a_stop_signal_pending_across_the_exec_stops_the_new_start(tmp_path):
    """What the exec of a reload hands over: SIGTERM blocked and pending. forkq start takes
    it once its handlers are in place and ends as a stop during the import does (exit 0),
    not after importing and running the app."""
    import os
    import subprocess
    import sys

    from helpers import forkq_command
    (tmp_path / "slow_app.py").write_text("raise SystemExit('the app was imported')\n")
    cmd = forkq_command("start", "--require", "slow_app.py", "--processes", "1")
    code = ("import os, signal, sys\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            f"os.execv(sys.executable, {cmd!r})\n")
    env = dict(os.environ, FORKQ_REDIS_URL="redis://127.0.0.1:1/0")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=15,
                          capture_output=True, text=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "stop requested while starting" in out and "the app was imported" not in out
