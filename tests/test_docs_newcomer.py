"""What a newcomer following README.md meets: real `python -m forkq` processes against a
real Redis, as the README has them run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from forkq import config
from helpers import json_lines, wait_until
from test_admin_cli import REPO_ROOT


def _start_and_stop(args: list[str], env: dict, cwd, log_path) -> None:
    """`forkq start ARGS` until its worker has started, then a graceful stop (exit 0)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", *args],
                                env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "worker started" in log_path.read_text(), timeout=30,
                   message="the worker started")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


@pytest.mark.timeout(60)
def test_a_misspelt_setting_in_the_environment_is_named_at_start(redis_url, tmp_path):
    """FORKQ_QUEUES=mail (the file's key is `queues` too) was ignored without a word: the
    worker served `default` only, and jobs pushed to `mail` waited for ever."""
    log_path = tmp_path / "worker.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO_ROOT),
               FORKQ_QUEUES="mail",
               # what Kubernetes sets for Services named forkq-redis and forkq: no mistake
               FORKQ_REDIS_SERVICE_HOST="10.0.0.3", FORKQ_REDIS_PORT="tcp://10.0.0.3:6379",
               FORKQ_PORT_9191_TCP_ADDR="10.0.0.4")
    _start_and_stop(["--no-fork", "--log-format", "json"], env, tmp_path, log_path)
    named = [line["event"] for line in json_lines(log_path) if "FORKQ_" in line["event"]]
    assert named == ["FORKQ_QUEUES is not a variable forkq reads, so it is ignored "
                     "(did you mean FORKQ_QUEUE?)"], named

    out = subprocess.run([sys.executable, "-m", "forkq", "start", "--print-config"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ("forkq: FORKQ_QUEUES is not a variable forkq reads, so it is ignored "
                          "(did you mean FORKQ_QUEUE?)\n")


@pytest.mark.timeout(30)
def test_every_variable_the_code_and_docs_name_is_one_forkq_reads():
    """The warning above must never name a variable forkq does read: each one the code or
    the docs mention passes, and an unrelated one gets no guess."""
    named: set[str] = set()
    sources = [*(REPO_ROOT / "forkq").rglob("*.py"), REPO_ROOT / "README.md",
               *(REPO_ROOT / "deploy").rglob("*.*"), *(REPO_ROOT / "systemd").iterdir()]
    for path in sources:
        named |= set(re.findall(r"\bFORKQ_[A-Z_]*[A-Z]\b", path.read_text()))
    assert {"FORKQ_REDIS_URL", "FORKQ_QUEUE", "FORKQ_CONFIG", "FORKQ_INDEX"} <= named
    assert config.unread_env({name: "x" for name in named}) == []
    assert config.unread_env({"FORKQ_THREADS": "5"}) == [
        "FORKQ_THREADS is not a variable forkq reads, so it is ignored"]


@pytest.mark.timeout(30)
def test_start_help_says_where_the_default_pidfile_is(tmp_path):
    """--help said /tmp/forkq.pid, where a newcomer with TMPDIR set (as macOS and many CI
    runners have it) found no pidfile: it is in $TMPDIR."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORKQ_PIDFILE", "FORKQ_CONFIG")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(REPO_ROOT))

    def forkq(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "forkq", "start", *args], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout

    (line,) = [x for x in forkq("--print-config").splitlines() if x.startswith("pidfile")]
    assert repr(str(tmp_path / "forkq.pid")) in line
    help_text = " ".join(forkq("--help").split())  # argparse wraps to the terminal's width
    assert "(default $FORKQ_PIDFILE, else forkq.pid in $TMPDIR or /tmp)" in help_text


@pytest.mark.timeout(60)
def test_a_misspelt_queue_to_work_is_named_at_start(r, redis_url, tmp_path):
    """`--queue mial` for the README's `mail`: the worker served a queue nothing reaches and
    said nothing, while the jobs waited on `mail`. A queue merely new (no job pushed yet, none
    registered: `critical` in the README's own command) is no mistake and gets no warning."""
    r.sadd("queues", "reports")  # pushed from elsewhere (a Ruby client), no job registered here
    log_path = tmp_path / "worker.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=f"{REPO_ROOT}:{REPO_ROOT / 'tests' / 'apps'}")
    args = ["--require", "core_jobs", "--no-fork", "--log-format", "json", "--queue", "critical,3",
            "--queue", "mial,2", "--queue", "default,1", "--queue", "report", "--queue", "reports"]
    _start_and_stop(args, env, tmp_path, log_path)
    named = {line["queue"]: line["similar"] for line in json_lines(log_path) if "similar" in line}
    assert named == {"mial": "mail", "report": "reports"}, named


@pytest.mark.timeout(30)
def test_redis_url_set_for_sidekiq_is_named_when_forkq_would_use_its_default(tmp_path):
    """Sidekiq (and many hosts' add-ons) read REDIS_URL: set alone, forkq served
    localhost without a word, and the jobs waited in the Redis REDIS_URL names."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}

    def warned(**extra: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "forkq", "start", "--print-config"],
                             env=dict(env, PYTHONPATH=str(REPO_ROOT), **extra), cwd=tmp_path,
                             capture_output=True, text=True, timeout=20)
        assert out.returncode == 0, out.stderr
        return [line for line in out.stderr.splitlines() if "REDIS_URL" in line]

    assert warned(REDIS_URL="redis://jobs.internal:6380/2") == [
        "forkq: REDIS_URL is set, but forkq reads FORKQ_REDIS_URL (or --redis-url, or redis-url "
        "in its config file): using the default, redis://127.0.0.1:6379/0"]
    assert warned(REDIS_URL="redis://jobs.internal:6380/2", FORKQ_REDIS_URL="redis://jobs.internal:6380/2") == []
    assert warned() == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url", ["localhost:6379", "Redis://localhost:6379/0", "http://localhost:6379"])
def test_a_url_without_a_scheme_forkq_takes_names_all_of_them(url, tmp_path):
    """redis-py's message listed redis://, rediss:// and unix:// only, not the Sentinel
    schemes forkq also takes."""
    out = subprocess.run([sys.executable, "-m", "forkq", "stats", "--redis-url", url],
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), cwd=tmp_path,
                         capture_output=True, text=True, timeout=20)
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr == (f"forkq: bad Redis URL {url!r}: a Redis URL starts with redis://, rediss://, "
                          "unix://, redis+sentinel://, rediss+sentinel:// (redis://localhost:6379/0, say)\n")


@pytest.mark.timeout(10)
def test_every_link_to_a_readme_section_names_one_of_its_headings():
    """The contents list (and any other in-page link) must follow a heading's rename:
    GitHub's anchors are the heading lowercased, punctuation other than - and _ dropped,
    spaces made dashes."""
    text = (REPO_ROOT / "README.md").read_text()
    heads, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            heads.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 20, links  # the contents list is there
    assert sorted(set(links) - heads) == []


@pytest.mark.timeout(60)
def test_recycling_flags_given_to_a_no_fork_worker_are_named_as_ignored(redis_url, tmp_path):
    """--max-memory and --max-jobs are the master's: a --no-fork worker took them without
    a word and never recycled anything."""
    log_path = tmp_path / "worker.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO_ROOT))
    _start_and_stop(["--no-fork", "--log-format", "json", "--max-jobs", "5", "--max-memory", "100"],
                    env, tmp_path, log_path)
    said = [line["event"] for line in json_lines(log_path) if "--max-jobs" in line["event"]]
    assert said == ["--max-memory and --max-jobs recycle the children of a master: with "
                    "--no-fork there is none, and they are ignored"], said
