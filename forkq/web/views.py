"""The dashboard's pages and actions. Each reads or changes Redis only through forkq.api
and forkq.control, so the dashboard shows and does exactly what `forkq stats`,
`forkq dead ...` and `forkq ctl` do."""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import json
import math
import re
import time
import zlib
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from .. import api, batch, control, keys
from .wsgi import BadRequest, Request, Response

if TYPE_CHECKING:
    from .app import Dashboard

# URL slug -> (sorted set, title, whether the newest entries come first)
SETS = {"retries": (keys.RETRY, "Retries", False),
        "scheduled": (keys.SCHEDULE, "Scheduled", False),
        "dead": (keys.DEAD, "Dead", True)}
# what the buttons of each set may do (dead jobs cannot be killed again)
SET_ACTIONS = {"retries": ("retry", "delete", "kill"), "scheduled": ("retry", "delete", "kill"),
               "dead": ("retry", "delete")}


def label(slug: str, action: str) -> str:
    """A button's words: a scheduled job has not failed, so it is run now, not retried."""
    if action == "retry":
        return "Run now" if slug == "scheduled" else "Retry"
    return action.capitalize()


SEARCH_LIMIT = 50  # per set: a search scans pages until it has this many hits
# a batch page lists this many of its jobs' failures, the oldest first
BATCH_FAILURES_SHOWN = 500
# /batches lists this many, the newest first (`forkq batches --limit N` lists more)
BATCHES_SHOWN = 100


def overview(dash: "Dashboard", req: Request) -> Response:
    conn = dash.redis()
    busy = sum(p.busy for g in api.processes(conn) for p in g.processes)
    return dash.render(req, "overview.html", stats=api.stats(conn, days=7),
                       queues=api.queues(conn), busy=busy)


def stats_json(dash: "Dashboard", req: Request) -> Response:
    """What the overview's chart polls: cumulative counters stamped with Redis-independent
    wall time; the page turns successive samples into per-second rates."""
    conn = dash.redis()
    s = api.stats(conn, days=1)
    busy = sum(p.busy for g in api.processes(conn) for p in g.processes)
    _, today_processed, today_failed = s.history[0]
    return Response.json({"time": time.time(), "processed": s.processed, "failed": s.failed,
                          "enqueued": s.enqueued, "suspects": s.suspects, "scheduled": s.scheduled,
                          "retries": s.retries, "dead": s.dead, "processes": s.processes,
                          "busy": busy, "today_processed": today_processed,
                          "today_failed": today_failed,
                          "queues": [{"name": q.name, "size": q.size, "suspects": q.suspects,
                                      "latency": q.latency} for q in api.queues(conn)]})


def processes(dash: "Dashboard", req: Request) -> Response:
    return dash.render(req, "processes.html", groups=api.processes(dash.redis()))


def signal(dash: "Dashboard", req: Request) -> Response:
    """Quiet or stop one process, or every child of one master, through their `-signals`
    lists (the master has no list of its own: each child reads its own)."""
    verb, _, rest = req.field("do").partition("|")
    kind, _, target = rest.partition("|")
    signame = {"quiet": "TSTP", "stop": "TERM"}.get(verb)
    if signame is None or kind not in ("identity", "master") or not target:
        raise BadRequest("expected do=quiet|stop + |identity|ID or |master|ID")
    conn = dash.redis()
    if kind == "identity":
        idents = [target]
    else:
        idents = [p.identity for g in api.processes(conn) if g.master == target for p in g.processes]
    sent = [i for ident in idents for i in control.remote_signal(conn, signame, identity=ident)]
    dash.flash(req, f"{verb}: signalled {len(sent)} process{'es' if len(sent) != 1 else ''}")
    return Response.redirect(req.url("/processes"))


def busy(dash: "Dashboard", req: Request) -> Response:
    return dash.render(req, "busy.html", jobs=api.running(dash.redis()), now=time.time())


def _digest(raw: bytes) -> str:
    return hashlib.sha1(raw).hexdigest()[:20]


def entry_key(entry: api.Entry) -> str:
    """Names one member for a button: its exact score (found by ZRANGEBYSCORE, no scan) and
    a digest of its bytes (the member itself may be huge, and jids may repeat)."""
    return f"{entry.score!r}~{_digest(entry.raw)}"


def _lookup(zset: api.SortedSet, key: str) -> api.Entry | None:
    score_text, _, digest = key.partition("~")
    try:
        score = float(score_text)
    except ValueError:
        return None
    if not math.isfinite(score) or not digest:
        return None
    for raw, s in zset.redis.zrangebyscore(zset.name, score, score, withscores=True):
        if _digest(raw) == digest:
            return api.Entry.of(raw, s)
    return None


def queued_key(entry: api.Entry) -> str:
    """Names one queued job for its Delete button: its index when the page was read and a
    digest of its bytes (the list shifts as jobs are pushed and run, so the index alone
    would name another job a moment later)."""
    return f"{int(entry.score)}~{_digest(entry.raw)}"


# how far past its old index a queued job is looked for: a job's index from the left
# grows by one with every job pushed after the page was read. Past the window the search
# goes on in raw chunks (no parsing) up to QUEUE_SEARCH_MAX entries: a click on a busy
# queue's page must still find its job, and must not read a queue of millions whole.
QUEUE_SLACK_BEFORE, QUEUE_SLACK_AFTER = 100, 1_000
QUEUE_SEARCH_CHUNK, QUEUE_SEARCH_MAX = 2_000, 200_000


def _lookup_queued(queue: api.Queue, key: str) -> api.Entry | None:
    index_text, _, digest = key.partition("~")
    # ASCII digits only ("²".isdigit() is true), and an index Redis can take
    if not (index_text.isascii() and index_text.isdigit() and len(index_text) < 18) or not digest:
        return None
    index = int(index_text)
    start = max(0, index - QUEUE_SLACK_BEFORE)
    for entry in queue.page(start, index - start + QUEUE_SLACK_AFTER):
        if _digest(entry.raw) == digest:
            return entry
    # pushes moved it further right (a job only moves left when one before it is removed,
    # and the window's slack covers that)
    at = index + QUEUE_SLACK_AFTER
    while at < index + QUEUE_SEARCH_MAX:
        rows = queue.redis.lrange(queue.key, at, at + QUEUE_SEARCH_CHUNK - 1)
        for i, raw in enumerate(rows):
            if _digest(raw) == digest:
                return api.Entry.of(raw, float(at + i))
        if len(rows) < QUEUE_SEARCH_CHUNK:
            return None
        at += len(rows)
    return None


def queues_page(dash: "Dashboard", req: Request) -> Response:
    conn = dash.redis()
    queues = api.queues(conn)
    pauses = api.paused(conn) if any(q.paused for q in queues) else {}
    return dash.render(req, "queues.html", queues=queues, pauses=pauses, now=time.time())


def queue_page(dash: "Dashboard", req: Request, name: str) -> Response:
    """One queue's jobs in pages, newest first as Sidekiq shows them, or with
    ?direction=asc the next to run first; then its crash suspects, if any wait."""
    conn = dash.redis()
    queue = api.Queue(conn, name)
    total = queue.size()
    # a queue out of the `queues` set whose crash suspects still wait is shown, not a 404
    suspects = api.Suspects(conn, name)
    suspect_total = suspects.size()
    pause = api.paused(conn).get(name)
    if not total and not suspect_total and pause is None and not queue.listed():
        return dash.render(req, "error.html", status="404 Not Found", back=("/queues", "Queues"),
                           message=f"There is no queue named {visible(capped(name, 200))}.")
    pages = max(1, math.ceil(total / dash.page_size))
    page = min(req.int_arg("page"), pages)
    next_first = req.arg("direction") == "asc"
    entries = queue.page((page - 1) * dash.page_size, dash.page_size, next_first)
    # the first page of them only: suspects are few, and they leave as workers take them
    shown = suspects.page(0, dash.page_size) if suspect_total else []
    return dash.render(req, "queue.html", name=name, entries=entries, total=total, page=page,
                       pages=pages, next_first=next_first, key=queued_key, now=time.time(),
                       suspects=shown, suspect_total=suspect_total, pause=pause)


def queue_action(dash: "Dashboard", req: Request, name: str) -> Response:
    """The Delete button of one queued job: do=delete|KEY. It removes exactly the bytes it
    finds under KEY; a job that has run meanwhile (or was pushed past QUEUE_SEARCH_MAX
    newer jobs) is not found. do=delete-all empties the queue (api.Queue.clear). do=pause
    (with an optional reason) and do=resume pause and resume the whole queue for every
    process (forkq.pause)."""
    action, _, key = req.field("do").partition("|")
    if action in ("pause", "resume"):
        return _pause_action(dash, req, name, action)
    if action == "delete-all":
        return _clear_action(dash, req, name)
    if action != "delete":
        raise BadRequest(f"unknown action {action!r} for a queue")
    queue = api.Queue(dash.redis(), name)
    entry = _lookup_queued(queue, key)
    done = queue.delete(entry.raw) if entry is not None else 0
    dash.flash(req, f"delete: {done} job{'s' if done != 1 else ''}")
    return Response.redirect(dash.back(req, "/queues/" + quote(name)))


def _clear_action(dash: "Dashboard", req: Request, name: str) -> Response:
    """The queue's "Delete all": every waiting job, each ended (api.Queue.clear)."""
    done = api.Queue(dash.redis(), name).clear()
    dash.flash(req, f"delete: {done} job{'s' if done != 1 else ''} (workers may have taken some meanwhile)")
    return Response.redirect(dash.back(req, "/queues/" + quote(name)))


def cancel_action(dash: "Dashboard", req: Request) -> Response:
    """The Cancel buttons (Busy, a queue, Scheduled, Retries, a job's page): jid=JID. It
    does not wait for a worker: a waiting job goes to the dead set at once, a running one
    is stopped by its worker at its next heartbeat (forkq.cancel)."""
    jid = req.field("jid")
    try:
        out = api.cancel(dash.redis(), jid, by=f"dashboard ({req.environ.get('REMOTE_ADDR') or 'unknown'})",
                         wait=0)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    detail = ("its worker stops it at its next heartbeat" if out.state == "pending"
              else out.detail)
    dash.flash(req, f"cancel {capped(jid, 100)}: {out.state.replace('_', ' ')}: {capped(detail, 300)}")
    return Response.redirect(dash.back(req, "/jobs/" + quote(jid, safe="")))


def job_by_jid(dash: "Dashboard", req: Request, jid: str) -> Response:
    """Where a job is now (forkq job JID), with a Cancel button while it waits or runs."""
    from .. import cancel
    try:
        where = api.locate(dash.redis(), jid)
    except ValueError:
        return dash.render(req, "error.html", status="404 Not Found", back=("/busy", "Busy"),
                           message=f"{visible(capped(jid, 200))} is not a jid.")
    live = where.state in (*cancel.WAITING, "running", "claimed")
    return dash.render(req, "lookup.html", where=where, live=live, now=time.time())


def _pause_action(dash: "Dashboard", req: Request, name: str, action: str) -> Response:
    conn = dash.redis()
    try:
        if action == "pause":
            reason = req.field("reason").strip()[:500] or None
            changed = api.pause(conn, name, reason, f"dashboard ({req.environ.get('REMOTE_ADDR') or 'unknown'})")
        else:
            changed = api.resume(conn, name)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    done = "paused" if action == "pause" else "resumed"
    dash.flash(req, f"{done}: processes honour it at their next heartbeat" if changed
               else f"already {'paused' if action == 'pause' else 'active'}")
    return Response.redirect(dash.back(req, "/queues/" + quote(name)))


def set_page(dash: "Dashboard", req: Request, slug: str) -> Response:
    name, title, newest_first = SETS[slug]
    zset = api.SortedSet(dash.redis(), name, page_size=dash.page_size)
    total = zset.size()
    pages = max(1, math.ceil(total / dash.page_size))
    page = min(req.int_arg("page"), pages)
    if newest_first:
        # ranks are lowest score first: page 1 is the highest ranks, reversed
        end = total - (page - 1) * dash.page_size
        start = max(0, end - dash.page_size)
        entries = list(reversed(zset.page(start, end - start))) if end > 0 else []
    else:
        entries = zset.page((page - 1) * dash.page_size)
    return dash.render(req, "set.html", slug=slug, title=title, entries=entries, total=total,
                       page=page, pages=pages, actions=SET_ACTIONS[slug], now=time.time(),
                       key=entry_key)


def set_action(dash: "Dashboard", req: Request, slug: str) -> Response:
    """Per-entry buttons post do=ACTION|KEY; bulk buttons post bulk=ACTION with the checked
    keys, or bulk=ACTION-all for the whole set."""
    name, _, _ = SETS[slug]
    zset = api.SortedSet(dash.redis(), name)
    allowed = SET_ACTIONS[slug]
    if req.field("do"):
        action, _, key = req.field("do").partition("|")
        keys_ = [key]
    else:
        action, keys_ = req.field("bulk"), req.form.get("key", [])
    whole = action.endswith("-all")
    action = action.removesuffix("-all")
    if action not in allowed:
        raise BadRequest(f"unknown action {action!r} for {slug}")
    method = {"retry": zset.retry_now, "delete": zset.delete, "kill": zset.kill}[action]
    if whole:
        done = zset.clear() if action == "delete" else zset.apply(method)
    else:
        chosen = [e for e in (_lookup(zset, k) for k in keys_[:10_000]) if e is not None]
        done = method(chosen) if chosen else 0
    dash.flash(req, f"{action}: {done} job{'s' if done != 1 else ''}")
    return Response.redirect(dash.back(req, f"/{slug}"))


# What a job's page shows of a hostile payload: enough to diagnose, never a page of
# hundreds of megabytes. Whatever is cut says how much was left out.
FIELD_LIMIT = 10_000        # characters of one field (an argument, a message, an extra key)
ARGS_SHOWN = 100            # arguments listed one by one
EXTRAS_SHOWN = 200          # other fields, one row each
BACKTRACE_LINES = 500       # Sidekiq keeps every line unless the job's `backtrace` option caps it
BACKTRACE_BYTES = 1 << 20   # inflated size at most: a small zlib blob can inflate to gigabytes
PAYLOAD_LIMIT = 200_000     # characters of the whole payload under "payload"

# the fields a job's page shows in rows of their own (the rest are listed after them)
TIMES = (("created_at", "Created"), ("enqueued_at", "Enqueued"), ("failed_at", "Failed"),
         ("retried_at", "Retried"))
SHOWN = {"class", "wrapped", "args", "kwargs", "jid", "queue", "retry_count", "error_class",
         "error_message", "error_backtrace", "bid"} | {name for name, _ in TIMES}
# what the score of each set's entries means
SCORE_LABELS = {"retries": "Next retry", "scheduled": "Scheduled for", "dead": "Died"}


def capped(text: str, limit: int = FIELD_LIMIT) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit:,} more characters)"


def shown(value: Any, limit: int = FIELD_LIMIT) -> str:
    """One payload field for a job's page as JSON (a string in quotes, so "1" and 1
    differ), cut at `limit`, invisible characters written out."""
    text = as_json(value)
    return visible(capped(text if text is not None else "(nested too deeply to show)", limit))


def plain(value: Any, limit: int = FIELD_LIMIT) -> str:
    """As `shown`, but a string as itself: an error message, a class name."""
    return visible(capped(value, limit)) if isinstance(value, str) else shown(value, limit)


def backtrace(value: Any) -> tuple[list[str], str | None]:
    """A job's `error_backtrace` as lines, and a sentence saying what kept it from being
    shown whole. Sidekiq 6+ stores base64 (with Ruby's line breaks) of zlib-deflated JSON,
    as payload.decode_backtrace reads it; older Sidekiqs stored the JSON array itself."""
    if value is None:
        return [], None
    lines = value
    if isinstance(value, str):
        try:
            text = zlib.decompressobj().decompress(base64.b64decode(value), BACKTRACE_BYTES)
            if len(text) >= BACKTRACE_BYTES:  # inflating stopped there, with more to come
                limit = f"{BACKTRACE_BYTES:,}"
                return [], f"The backtrace inflates to more than {limit} bytes: not shown."
            lines = json.loads(text)
        except (binascii.Error, zlib.error, ValueError, RecursionError) as exc:
            why = capped(f"{type(exc).__name__}: {exc}", 200)
            return [], f"The backtrace cannot be decoded ({why})."
    if not isinstance(lines, list):
        return [], f"The backtrace is a JSON {type(lines).__name__}, not a list of lines."
    out = [capped(line if isinstance(line, str) else as_json(line) or "?", 2_000)
           for line in lines[:BACKTRACE_LINES]]
    if len(lines) > BACKTRACE_LINES:
        return out, f"… and {len(lines) - BACKTRACE_LINES:,} more lines, not shown."
    return out, None


def job_page(dash: "Dashboard", req: Request, slug: str, key: str) -> Response:
    """One entry of a set, every field of it (Sidekiq's /retries/:key, /morgue/:key,
    /scheduled/:key), with the list's buttons. `key` is the entry_key its row linked to."""
    name, title, _ = SETS[slug]
    entry = _lookup(api.SortedSet(dash.redis(), name), key)
    if entry is None:
        return dash.render(req, "error.html", status="404 Not Found", back=(f"/{slug}", title),
                           message=f"This job is not in {title} any more: it has been "
                                   "retried, deleted or moved since that link was made.")
    job = entry.job or {}
    lines, problem = backtrace(job.get("error_backtrace"))
    args = job["args"] if isinstance(job.get("args"), list) else []
    kwargs = list(job["kwargs"].items()) if isinstance(job.get("kwargs"), dict) else []
    extras = sorted((k, v) for k, v in job.items() if k not in SHOWN)
    return dash.render(req, "job.html", slug=slug, title=title, entry=entry, job=job, key=key,
                       args=args[:ARGS_SHOWN], more_args=max(0, len(args) - ARGS_SHOWN),
                       kwargs=kwargs[:ARGS_SHOWN], more_kwargs=max(0, len(kwargs) - ARGS_SHOWN),
                       times=[(label_, job[f]) for f, label_ in TIMES if f in job],
                       extras=extras[:EXTRAS_SHOWN],
                       more_extras=max(0, len(extras) - EXTRAS_SHOWN),
                       score_label=SCORE_LABELS[slug], backtrace=lines,
                       backtrace_problem=problem, actions=SET_ACTIONS[slug], now=time.time())


def batches_page(dash: "Dashboard", req: Request) -> Response:
    """The newest batches (forkq.batch.recent), all or those in one state (?state=)."""
    state = req.arg("state")
    if state and state not in batch.STATES:
        raise BadRequest(f"unknown state {state!r}: expected one of {', '.join(batch.STATES)}")
    found = batch.recent(dash.redis(), BATCHES_SHOWN, [state] if state else None)
    return dash.render(req, "batches.html", batches=found, state=state, states=batch.STATES,
                       limit=BATCHES_SHOWN, now=time.time())


# the periods /metrics-by-class offers, in minutes: Sidekiq 7's (its keys live 8 hours)
METRICS_PERIODS = (60, 120, 240, 480)
_PERIOD_TEXTS = tuple(map(str, METRICS_PERIODS))


def metrics_page(dash: "Dashboard", req: Request) -> Response:
    """Per-class job metrics (api.job_metrics) over ?minutes= (one of METRICS_PERIODS):
    every class, most time first; with ?class=, that class's minutes and histogram."""
    # the text itself, not int_arg: that reads "abc" as the default and "-5" as 1, and int()
    # takes " 60" and "6_0"; a link with a typo must say so, not show another period
    text = req.arg("minutes", str(METRICS_PERIODS[0]))
    if text not in _PERIOD_TEXTS:
        raise BadRequest(f"minutes must be one of {', '.join(_PERIOD_TEXTS)}, not {text[:40]!r}")
    minutes = int(text)
    klass = req.arg("class") or None
    data = api.job_metrics(dash.redis(), minutes, klass)
    minutes_shown = []
    if klass is not None and data["classes"]:
        s = data["classes"][0]["series"]
        minutes_shown = [(b, p, f, ms) for b, p, f, ms in
                         zip(data["buckets"], s["processed"], s["failed"], s["ms"]) if p]
    return dash.render(req, "metrics.html", data=data, klass=klass, minutes=minutes,
                       periods=METRICS_PERIODS, minutes_shown=minutes_shown[::-1])


def batch_page(dash: "Dashboard", req: Request, bid: str) -> Response:
    """A batch's status (forkq.batch_status): its counts, its callbacks' state, and the
    last failure of each of its jobs that has not succeeded since."""
    status = batch.read_status(dash.redis(), bid)
    if status is None:
        return dash.render(req, "error.html", status="404 Not Found", back=("/", "Overview"),
                           message=f"There is no batch {visible(capped(bid, 200))} in Redis: never "
                                   "opened, or expired (24 hours after it succeeded, 30 days "
                                   "after its latest job ended).")
    failures = sorted(status.failures.items(), key=lambda item: item[1].get("at") or 0)
    return dash.render(req, "batch.html", batch=status, failures=failures[:BATCH_FAILURES_SHOWN],
                       more_failures=max(0, len(failures) - BATCH_FAILURES_SHOWN), now=time.time())


def search(dash: "Dashboard", req: Request) -> Response:
    """Entries of the three sets, and running jobs, whose jid or class is the query. A jid
    is not indexed, so this is a paged scan that stops at SEARCH_LIMIT hits per set."""
    q = req.arg("q").strip()
    results: list[tuple[str, str, list[api.Entry]]] = []
    running: list[api.RunningJob] = []
    found_batch = None
    if q:
        conn = dash.redis()
        found_batch = batch.read_status(conn, q)
        needle = q.encode()
        def hit(entry: api.Entry) -> bool:
            if needle not in entry.raw:  # cheap bytes test before looking at the job
                return False
            return entry.jid == q or entry.klass == q or (entry.job or {}).get("class") == q
        for slug, (name, title, _) in SETS.items():
            zset = api.SortedSet(conn, name)
            found = list(itertools.islice(zset.entries(hit), SEARCH_LIMIT))
            results.append((slug, title, found))
        running = [j for j in api.running(conn) if j.job and (
            j.job.get("jid") == q or j.job.get("class") == q or j.job.get("wrapped") == q)]
    return dash.render(req, "search.html", q=q, results=results, running=running, batch=found_batch,
                       actions=SET_ACTIONS, key=entry_key, now=time.time(), limit=SEARCH_LIMIT)


# What a browser draws as nothing, or lets reorder the text around it: C0 and C1 controls
# (ANSI colours in an error message), DEL, zero-width and bidi controls, lone surrogates.
# Tab, newline and carriage return are only whitespace to HTML.
_INVISIBLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e"
                        "\u2060-\u2069\ufeff\ud800-\udfff]")


def visible(value: Any) -> str:
    """Payload text with each such character written out as \\uXXXX: the page shows what
    the string holds, not a blank or a reversed line. A value that should have been a string
    (a queue name that is a number) is shown as JSON."""
    text = value if isinstance(value, str) else as_json(value) or "(nested too deeply)"
    return _INVISIBLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def as_json(value: Any, indent: int | None = None, sort_keys: bool = False) -> str | None:
    """JSON for display, or None when the value is nested too deeply to encode again (the
    parser allows about 1,000 levels; the indenting encoder recurses in Python and may not)."""
    try:
        return json.dumps(value, indent=indent, sort_keys=sort_keys, ensure_ascii=False,
                          default=str)
    except RecursionError:
        return None


def job_json(job: dict[str, Any] | None, raw: bytes = b"") -> str:
    """A payload pretty-printed, or its bytes as stored when that cannot be done; cut at
    PAYLOAD_LIMIT characters."""
    text = as_json(job, indent=2, sort_keys=True) if job is not None else None
    return visible(capped(text if text is not None else raw.decode("utf-8", "replace"),
                          PAYLOAD_LIMIT))
