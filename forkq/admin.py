"""The admin commands: `forkq stats`, `queues`, `queue NAME`, `processes`, `busy`, `metrics`,
`suspects`, `cron`, `batch`, `batches` and the dead, retry and schedule sets. Read-only views
and bulk actions on what is in Redis, as tables for people and --json for scripts; the data
comes from forkq.api."""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Collection, Sequence
from typing import Any

from . import config
from .cli import ArgumentParser, _flag_type, nonempty, redis_errors, whole_number
from .errors import ConfigError

# --limit's ceiling: what itertools.islice and Redis's LRANGE indexes take; above it a list
# ended in an internal error instead of a usage line
LIMIT_MAX = 2 ** 62


# sorted set -> (its actions besides list, the verb for moving entries onto their queues)
SET_ACTIONS = {"dead": ("retry", "delete"), "retry": ("retry-now", "delete", "kill"),
               "schedule": ("run-now", "delete", "kill")}


# the verbs that put entries back on their queues: a malformed entry has none to go to
RUN_VERBS = ("retry", "retry-now", "run-now")

# forkq.batch.STATES, spelled out: importing forkq.batch pulls in redis-py (0.1 s), which
# a usage error or --help does not wait for (a test holds the two equal)
BATCH_STATES = ("open", "running", "complete", "succeeded", "abandoned")
BATCHES_SCAN = 2000  # forkq.batch.LOOK_AT, as BATCH_STATES

MALFORMED_HELP = ("entries that are no runnable job: forkq.MalformedJob (a payload forkq "
                  "could not parse) and members that do not parse")


def add_admin_commands(sub: argparse._SubParsersAction) -> None:
    """stats, queues, processes, busy, suspects and the dead/retry/schedule sets:
    read-only views and bulk actions on what is in Redis, for people (tables) and scripts
    (--json)."""
    common = ArgumentParser(add_help=False)
    common.add_argument("--redis-url", default=None, type=_flag_type(config.BY_KEY["redis_url"]),
                        help="Redis URL [env FORKQ_REDIS_URL]")
    common.add_argument("--config", metavar="PATH", default=None, type=nonempty,
                        help="the TOML file start was given, for its redis-url (default: "
                             "./pyproject.toml's [tool.forkq] if any) [env FORKQ_CONFIG]")
    common.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    p = sub.add_parser("stats", parents=[common], help="processed/failed totals, set sizes, crash suspects, daily history")
    p.add_argument("--days", type=whole_number("--days", 1, 3660), default=7, help="days of history (default 7)")
    sub.add_parser("queues", parents=[common], help="each queue: size, crash suspects, latency, paused or not")
    sub.add_parser("processes", parents=[common], help="live processes grouped by master")
    sub.add_parser("busy", parents=[common], help="the jobs running now, longest-running first")
    p = sub.add_parser("metrics", parents=[common],
                       help="per-class job metrics of the last minutes: runs, failures, time, "
                            "p50/p95 (Sidekiq 7's metrics in Redis), most time first")
    p.add_argument("--minutes", type=whole_number("--minutes", 1, 480), default=60,
                   help="how many minutes back, this one included (default 60; Redis keeps 480)")
    p.add_argument("--class", dest="klass", metavar="NAME", help="only this class")
    p = sub.add_parser("suspects", parents=[common],
                       help="a queue's crash suspects, next to run first, with their crash counts")
    p.add_argument("queue", type=nonempty, help="the queue whose suspects to list")
    p.add_argument("--limit", type=whole_number("--limit", 1, LIMIT_MAX), default=100,
                   help="show at most this many (default 100)")
    p = sub.add_parser("cron", parents=[common],
                       help="the periodic entries the app declares: schedule, next due time, last push")
    p.add_argument("-r", "--require", action="append", metavar="MODULE_OR_PATH", type=nonempty,
                   help="the app's module or .py file that declares them, as forkq start takes it "
                        "(repeatable; default: start's require setting) [env FORKQ_REQUIRE]")
    p = sub.add_parser("batch", parents=[common],
                       help="a batch's status: its counts, callbacks fired, and its jobs' failures")
    p.add_argument("bid", type=nonempty, help="the batch's id (forkq.Batch().bid)")
    p.add_argument("--limit", type=whole_number("--limit", 1, LIMIT_MAX), default=100,
                   help="show at most this many failures (default 100)")
    p = sub.add_parser("batches", parents=[common],
                       help="the batches Redis holds, newest first: state, total, pending, failed")
    p.add_argument("--limit", type=whole_number("--limit", 1, LIMIT_MAX), default=100,
                   help="show at most this many (default 100)")
    p.add_argument("--state", action="append", choices=BATCH_STATES,
                   help="only batches in this state (repeatable)")
    p.add_argument("--scan", metavar="N", type=whole_number("--scan", 1, LIMIT_MAX),
                   default=BATCHES_SCAN,
                   help=f"look at the newest N batches at most, or --limit if more (default "
                        f"{BATCHES_SCAN}; Redis indexes the newest 10,000)")
    for verb, what in (("pause", "stop every process claiming a queue's jobs (they stay queued)"),
                       ("resume", "let processes claim a paused queue's jobs again")):
        p = sub.add_parser(verb, parents=[common], help=what)
        p.add_argument("queue", type=nonempty, help=f"the queue to {verb}")
        if verb == "pause":
            p.add_argument("--reason", help="why, shown by `forkq queues --json` and the dashboard")
        p.add_argument("--wait", type=whole_number("--wait", 0, 86400), default=30, metavar="SECONDS",
                       help="wait up to this long for every live process working the queue to "
                            "report that it honours the change (default 30; 0: do not wait)")
    p = sub.add_parser("job", parents=[common],
                       help="where a job is now, by its jid: queue and position, schedule, retry, "
                            "running (where), dead, finished")
    p.add_argument("jid", help="the job's jid")
    p = sub.add_parser("cancel", parents=[common],
                       help="cancel jobs by jid: a waiting one goes to the dead set, a running "
                            "one is stopped by its worker")
    p.add_argument("jids", nargs="+", metavar="JID", help="the jobs' jids")
    p.add_argument("--reason", help="why, kept in the job's error_message in the dead set")
    p.add_argument("--wait", type=whole_number("--wait", 0, 86400), default=30, metavar="SECONDS",
                   help="wait up to this long in all for workers to stop running jobs "
                        "(default 30; 0: do not wait, the request stays for the worker)")
    p = sub.add_parser("push", parents=[common],
                       help="push one job by its name (from a shell, a deploy script, cron)")
    p.add_argument("name", type=nonempty, help="the job's name (@forkq.job's name, or a Sidekiq class)")
    p.add_argument("--args", metavar="JSON", default="[]", help="its positional arguments, a JSON array")
    p.add_argument("--kwargs", metavar="JSON", default=None,
                   help="its keyword arguments, a JSON object (for a job a forkq worker runs)")
    p.add_argument("--queue", type=nonempty, default=None,
                   help="the queue (default: the job's own with the app loaded, else default)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--in", dest="delay", type=float, metavar="SECONDS", help="run it that many seconds from now")
    when.add_argument("--at", metavar="WHEN", help="run it then: epoch seconds, or ISO 8601 with a UTC offset")
    p.add_argument("-r", "--require", action="append", metavar="MODULE_OR_PATH", type=nonempty,
                   help="the app, to push a job it declares with its own options and check its "
                        "arguments against the function [env FORKQ_REQUIRE]")
    p = sub.add_parser("queue", help="list a queue's waiting jobs, or delete some or all of them")
    p.add_argument("queue_name", metavar="NAME", type=nonempty, help="the queue")
    verbs = p.add_subparsers(dest="action", required=True, parser_class=ArgumentParser)
    listing = verbs.add_parser("list", parents=[common], help="its waiting jobs, next to run first")
    listing.add_argument("--jid", help="only this job")
    listing.add_argument("--class", dest="klass", metavar="NAME", help="only jobs of this class")
    listing.add_argument("--limit", type=whole_number("--limit", 1, LIMIT_MAX), default=100,
                         help="show at most this many (default 100)")
    a = verbs.add_parser("delete", parents=[common],
                         help="delete the chosen jobs, each ended (unique lock released, batch "
                              "failure counted); workers may take some meanwhile")
    pick = a.add_mutually_exclusive_group(required=True)
    pick.add_argument("--jid", help="the job with this jid")
    pick.add_argument("--class", dest="klass", metavar="NAME", help="every job of this class")
    pick.add_argument("--all", action="store_true", help="every job")
    for name, actions in SET_ACTIONS.items():
        p = sub.add_parser(name, help=f"list or act on the {name} set")
        verbs = p.add_subparsers(dest="action", required=True, parser_class=ArgumentParser)
        listing = verbs.add_parser("list", parents=[common], help=f"entries of the {name} set, oldest first")
        listing.add_argument("--jid", help="only this job")
        listing.add_argument("--class", dest="klass", metavar="NAME", help="only jobs of this class")
        listing.add_argument("--queue", help="only jobs of this queue")
        listing.add_argument("--malformed", action="store_true", help=MALFORMED_HELP)
        listing.add_argument("--limit", type=whole_number("--limit", 1, LIMIT_MAX), default=100,
                             help="show at most this many (default 100)")
        for verb in actions:
            a = verbs.add_parser(verb, parents=[common], help=f"{verb} the chosen entries")
            pick = a.add_mutually_exclusive_group(required=True)
            pick.add_argument("--jid", help="the entry with this jid")
            pick.add_argument("--class", dest="klass", metavar="NAME", help="every entry of this class")
            pick.add_argument("--queue", help="every entry of this queue")
            pick.add_argument("--all", action="store_true", help="every entry")
            # retry and run-now refuse it with a line saying why, so it stays accepted there,
            # but --help offers it only where it does something
            pick.add_argument("--malformed", action="store_true",
                              help=argparse.SUPPRESS if verb in RUN_VERBS else MALFORMED_HELP)


COMMANDS = ("stats", "queues", "processes", "busy", "metrics", "suspects", "cron", "batch",
            "batches", "pause", "resume", "push", "job", "cancel", "queue", *SET_ACTIONS)


def run(args: argparse.Namespace) -> int:
    """Run one admin command; a Redis failure is one line naming the (masked) URL."""
    import redis
    from . import api, client
    from .errors import RedisUnavailable
    try:
        url = client.redis_url(config.redis_url_for_tools(args.redis_url, args.config))
        if args.command == "cron":
            args.entries = _load_entries(args)  # before Redis: a bad app is no Redis matter
        if args.command == "push":
            _push_plan(args)  # all checked before Redis is asked anything
        if args.command in ("job", "cancel"):
            _check_jids(args)
    except ConfigError as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    try:
        conn = api.connect(url)
        if args.command in SET_ACTIONS:
            return _set_command(conn, args)
        if args.command == "queue":
            return _queue_command(conn, args)
        if args.command == "batch":
            return _batch(conn, args)
        if args.command in ("pause", "resume"):
            return _pause(conn, args)
        if args.command == "push":
            return _push(url, args)
        if args.command == "job":
            return _job(conn, args)
        if args.command == "cancel":
            return _cancel(conn, args)
        data, table = {"stats": _stats, "queues": _queues, "processes": _processes,
                       "busy": _busy, "metrics": _metrics, "suspects": _suspects, "cron": _cron,
                       "batches": _batches}[args.command](conn, args)
    except redis_errors() as exc:
        sys.stderr.write(f"forkq: {client.unreachable(client.mask_url(url), exc, url)}\n")
        return 1
    except RedisUnavailable as exc:  # push's Client: its message says whether it was pushed
        sys.stderr.write(f"forkq: {exc}\n")
        return 1
    except redis.RedisError as exc:
        sys.stderr.write(f"forkq: Redis at {client.mask_url(url)} answered with an error: "
                         f"{type(exc).__name__}: {exc}\n")
        return 1
    _emit(args, data, table)
    return 0


def _emit(args: argparse.Namespace, data: object, table: list[str]) -> None:
    import json
    print(json.dumps(_strict(data), indent=2, default=str, allow_nan=False) if args.json
          else "\n".join(table))


def _strict(data: object) -> object:
    """A copy with NaN and Infinity as null: Python's json reads them from any client's
    payload (and a Redis score may be inf) and would write them back, but they are not
    JSON, and jq or JSON.parse reading --json would refuse the whole output. A loop, not
    recursion: a payload nested as deep as json.loads allows must not hit the stack limit."""
    root: list[object] = [None]
    todo: list[tuple[object, Any, Any]] = [(data, root, 0)]
    while todo:
        value, parent, key = todo.pop()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        elif isinstance(value, dict):
            copy: dict[Any, object] = dict.fromkeys(value)  # keeps the key order
            todo += [(item, copy, k) for k, item in value.items()]
            value = copy
        elif isinstance(value, (list, tuple)):
            items: list[object] = [None] * len(value)
            todo += [(item, items, i) for i, item in enumerate(value)]
            value = items
        parent[key] = value
    return root[0]


def _table(header: list[str], rows: Sequence[Sequence[object]], right: Collection[int] = ()) -> list[str]:
    """Columns as wide as their widest cell; numbers right-aligned, text left-aligned.
    `right` names columns of numbers given as text (formatted, or "<20") to align as numbers."""
    cells = [[str(c) for c in header]] + [["-" if c is None else _printable(str(c)) for c in row]
                                          for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [(all(isinstance(row[i], (int, float)) for row in rows) or i in right) and rows
               for i in range(len(header))]
    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(row, widths, numeric)).rstrip()
    return [line(r) for r in cells]


# and zero-width and bidi controls (U+202E would show a line reversed), as the dashboard's
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _printable(text: str) -> str:
    """A cell as one line, with no terminal escapes: payloads and error messages are input."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _stats(conn, args):
    from dataclasses import asdict
    from . import api
    s = api.stats(conn, args.days)
    data = asdict(s)
    data["history"] = [{"day": d, "processed": p, "failed": f} for d, p, f in s.history]
    table = _table(["processed", "failed", "enqueued", "suspects", "scheduled", "retries", "dead",
                    "processes", "busy", "default latency"],
                   [[s.processed, s.failed, s.enqueued, s.suspects, s.scheduled, s.retries, s.dead,
                     s.processes, s.busy, _age(s.default_latency)]])
    table += [""] + _table(["day (UTC)", "processed", "failed"], [list(h) for h in s.history])
    return data, table


def _metrics(conn, args):
    from . import api
    data = api.job_metrics(conn, args.minutes, args.klass)
    rows = [[c["class"], c["processed"], c["failed"], f"{c['failure_pct']:.1f}",
             f"{c['total_ms'] / 1000:.1f}", "-" if c["avg_ms"] is None else f"{c['avg_ms']:.1f}",
             _bound(c, "p50_ms"), _bound(c, "p95_ms")] for c in data["classes"]]
    table = _table(["class", "processed", "failed", "failed %", "total s", "avg ms", "p50 ms",
                    "p95 ms"], rows, right=range(1, 8))
    table.append(f"(last {data['minutes']} min to {data['buckets'][-1]} UTC; times of successful jobs"
                 f"{'' if rows else '; no jobs recorded'})")
    return data, table


def _bound(row: dict, name: str) -> str:
    """A quantile as its histogram bucket's bound: "<20", or ">335000" past the last."""
    from .jobmetrics import BUCKET_MS
    if row[name] is not None:
        return f"<{row[name]}"
    if row["histogram"] and sum(row["histogram"]):
        return f">{BUCKET_MS[-1]}"
    return "-"


def _batch(conn, args) -> int:
    from dataclasses import asdict
    from . import batch
    status = batch.read_status(conn, args.bid)
    if status is None:
        sys.stderr.write(f"forkq: no batch {_printable(args.bid)!r} in Redis (never opened, or "
                         "expired: a batch's keys go 24 hours after it succeeded, 30 days after "
                         "its latest job ended)\n")
        return 1
    state = status.state
    failures = sorted(status.failures.items(), key=lambda item: item[1].get("at") or 0)
    now = time.time()
    table = _table(["bid", "description", "state", "total", "pending", "failed", "age"],
                   [[status.bid, status.description, state, status.total, status.pending,
                     len(failures), _age(now - status.created_at)]])
    if failures:
        table += [""] + _table(["jid", "fate", "error", "message"], [
            [jid, f.get("fate"), f.get("error_class"), f.get("error_message")]
            for jid, f in failures[:args.limit]])
        if len(failures) > args.limit:
            table.append(f"... {len(failures) - args.limit} more (--limit)")
    _emit(args, dict(asdict(status), state=state), table)
    return 0


def _batches(conn, args):
    from dataclasses import asdict
    from . import batch
    found = batch.recent(conn, args.limit, args.state, args.scan)
    rows = [[b.bid, _cut(b.description, 40), _when(b.created_at), b.state, b.total, b.pending,
             b.failed] for b in found]
    table = _table(["bid", "description", "created (UTC)", "state", "total", "pending", "failed"],
                   rows) if rows else ["no batches" + (" in that state" if args.state else "")
                                       + (f" among the newest {found.looked_at}" if found.more else "") + " in Redis"]
    if found.more:
        more = (f"... more may exist: looked at the newest {found.looked_at} batches "
                "(--scan N looks further)")
        table.append(more)
        if args.json:  # the JSON stays a list
            sys.stderr.write(f"forkq: {more[4:]}\n")
    return [asdict(b) for b in found], table


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _queues(conn, args):
    from dataclasses import asdict
    from . import api
    qs = api.queues(conn)
    pauses = api.paused(conn) if any(q.paused for q in qs) else {}
    table = _table(["queue", "size", "suspects", "latency", "state"],
                   [[q.name, q.size, q.suspects, _age(q.latency), "paused" if q.paused else "active"]
                    for q in qs])
    data = [dict(asdict(q), pause=asdict(pauses[q.name]) if q.name in pauses else None) for q in qs]
    return data, table if qs else ["no queues"]


def _pause(conn, args) -> int:
    """`forkq pause QUEUE` / `forkq resume QUEUE`, then wait for the live processes that
    work it to report that they honour it: 1 if some did not in --wait seconds."""
    from . import pause
    queue, pausing = args.queue, args.command == "pause"
    try:
        pause.check_queue(queue)
    except ValueError as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    if pausing:
        changed = pause.pause(conn, queue, args.reason, _by())
    else:
        changed = pause.resume(conn, queue)
    state = "paused" if pausing else "resumed"
    name = _printable(queue)
    lines = [f"queue {name} {state}" if changed else f"queue {name} was already {state.replace('resumed', 'active')}"]
    late = pause.wait_honoured(conn, queue, args.wait, pausing) if args.wait else None
    procs = pause.working(conn, queue)
    working = [hb["identity"] for hb in procs]
    # Ruby Sidekiq, an older forkq (pause.blind): from the heartbeats read just above
    unaware = [hb["identity"] for hb in procs if hb["paused"] is None] if pausing else []
    # a process that never reads pauses honours none: counted there, not among these
    aware = [ident for ident in working if ident not in unaware]
    if late is None:
        if aware or not unaware:
            lines.append(f"{len(aware)} live processes work it; each honours this at its next heartbeat")
    elif not late:
        if aware or not unaware:
            lines.append(f"all {len(aware)} live processes working it honour this"
                         if aware else "no live process works it; those that start honour this")
    else:
        lines.append(f"{len(late)} of the live processes working it did not confirm within "
                     f"{args.wait} s (Redis slow to them, or stuck): {', '.join(map(_printable, late))}")
    if unaware:
        lines.append(f"{len(unaware)} live processes working it never read forkq's pauses (Ruby "
                     f"Sidekiq, or an older forkq) and go on running its jobs: "
                     f"{', '.join(map(_printable, unaware))}")
    _emit(args, {"queue": queue, "state": state, "changed": changed, "processes": working,
                 "unconfirmed": late, "unaware": unaware}, lines)
    return 1 if late or unaware else 0



def _by() -> str:
    """Who is acting, for a pause's or a cancel's record: user@host."""
    import getpass
    import socket
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # no user name for this uid (a container): the host says enough
        return socket.gethostname()


def _check_jids(args: argparse.Namespace) -> None:
    from .cancel import check_jid
    for jid in [args.jid] if args.command == "job" else args.jids:
        try:
            check_jid(jid)
        except ValueError as exc:
            raise ConfigError(_printable(str(exc))) from None


def _job(conn, args) -> int:
    """`forkq job JID`: where it is; 1 if it is nowhere."""
    from . import cancel
    where = cancel.locate(conn, args.jid)
    _emit(args, where.to_dict(), [f"{_printable(args.jid)}: {_printable(where.describe())}"])
    return 1 if where.state == "not_found" else 0


def _cancel(conn, args) -> int:
    """`forkq cancel JID...`: a line per jid; 0 only if every one was removed or stopped.
    --wait is shared (cancel.cancel_many)."""
    from . import cancel
    outcomes = cancel.cancel_many(conn, args.jids, args.reason, _by(), wait=args.wait)
    _emit(args, [o.to_dict() for o in outcomes],
          [f"{_printable(o.jid)}: {o.state.replace('_', ' ')}: {_printable(o.detail)}" for o in outcomes])
    return 0 if all(o.state in ("removed", "cancelled") for o in outcomes) else 1


def _processes(conn, args):
    from dataclasses import asdict
    from . import api
    groups = api.processes(conn)
    data = [{"master": g.master, "processes": [asdict(p) for p in g.processes]} for g in groups]
    rows = []
    for g in groups:
        for p in g.processes:
            rows.append([g.master or "(none)", p.slot, p.pid, f"{p.busy}/{p.concurrency or '?'}",
                         f"{p.rss_kb / 1024:.1f}", _age(p.beat_age),
                         "quiet" if p.quiet else f"running (paused: {','.join(p.paused)})" if p.paused else "running",
                         p.identity])
    header = ["master", "slot", "pid", "busy", "rss MB", "heartbeat", "state", "identity"]
    return data, _table(header, rows) if rows else ["no live processes"]


def _suspects(conn, args):
    from . import api
    suspects = api.Suspects(conn, args.queue)
    shown = suspects.page(0, args.limit)
    rows = [[e.jid, e.klass, e.crashes, _args_text(e.job)] for e in shown]
    total = suspects.size()
    table = _table(["jid", "class", "crashes", "args"], rows) if rows else [
        f"no crash suspects wait for queue {args.queue!r}"]
    if total > len(shown):
        table.append(f"({len(shown)} of {total:,}; --limit shows more)")
    return [e.to_dict() for e in shown], table


def _push_plan(args: argparse.Namespace) -> None:
    """Parse and check `forkq push`'s arguments (ConfigError: one line, exit 2): args.at
    (epoch seconds or None), args.values, args.keywords, and args.job (the app's Job when
    the app is loaded and declares the name)."""
    import json
    import math
    from datetime import datetime
    from . import payload
    try:
        values = json.loads(args.args)
        keywords = None if args.kwargs is None else json.loads(args.kwargs)
    except ValueError as exc:
        raise ConfigError(f"push: --args and --kwargs take JSON: {exc}") from None
    except RecursionError:
        raise ConfigError("push: --args or --kwargs is nested too deep") from None
    if not isinstance(values, list):
        raise ConfigError(f"push: --args must be a JSON array, not {type(values).__name__}")
    if keywords is not None and not isinstance(keywords, dict):
        raise ConfigError(f"push: --kwargs must be a JSON object, not {type(keywords).__name__}")
    try:
        payload.check_args(values)
        if keywords:
            payload.check_kwargs(keywords)
    except TypeError as exc:  # NaN or Infinity, which Python's json reads
        raise ConfigError(f"push: {exc}") from None
    except RecursionError:  # the check recurses; so would the push's encoding
        raise ConfigError("push: --args or --kwargs is nested too deep") from None
    try:  # a lone surrogate (\ud800) reads as JSON but no payload can be written with it
        json.dumps([values, keywords], ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ConfigError("push: --args or --kwargs holds a lone surrogate escape, which is "
                          "no UTF-8 text") from None
    args.values, args.keywords = values, keywords or {}
    when, args.at = args.at, None
    if args.delay is not None:
        if not math.isfinite(args.delay) or args.delay < 0:
            raise ConfigError("push: --in takes a number of seconds, 0 or more")
        args.at = time.time() + args.delay
    elif when is not None:
        try:
            at = float(when)
        except ValueError:
            try:
                parsed = datetime.fromisoformat(when)
            except ValueError:
                raise ConfigError(f"push: --at {when!r} is neither epoch seconds nor an ISO 8601 "
                                  "time") from None
            if parsed.tzinfo is None:
                raise ConfigError(f"push: --at {when!r} has no UTC offset (add Z or +02:00): "
                                  "a host's local time would push at another moment elsewhere")
            at = parsed.timestamp()
        if not math.isfinite(at):
            raise ConfigError(f"push: --at {when!r} is not a time")
        args.at = at
    if args.at is not None:
        try:  # what the output prints it with, checked before anything is pushed
            time.localtime(args.at)
        except (OverflowError, OSError, ValueError):
            raise ConfigError("push: --at or --in is out of range for a time") from None
    args.job = None
    modules = config.require_for_tools(args.require, args.config)
    if modules:
        from . import jobs
        from .cli import load_app
        load_app(modules)
        args.job = jobs.lookup(args.name)
        if args.job is None:  # a worker looks a named job up by its name, never its path
            for job in list(jobs.REGISTRY.values()):
                if f"{job.fn.__module__}.{job.fn.__qualname__}" == args.name:
                    raise ConfigError(f"push: the app declares {args.name} as job {job.name!r}: "
                                      "push that name, which its workers run")
        if args.job is not None:
            try:
                args.job.check_call(payload.check_args(values), args.keywords)
            except TypeError as exc:
                raise ConfigError(f"push: {exc}") from None


def _push(url: str, args: argparse.Namespace) -> int:
    from . import client
    c = client.Client(url)
    if args.job is not None:
        enqueuer = args.job.options(client=c, **({"queue": args.queue} if args.queue else {}))
        if args.at is None:
            jid = enqueuer.enqueue(*args.values, **args.keywords)
        else:
            jid = enqueuer.enqueue_at(args.at, *args.values, **args.keywords)
        queue = enqueuer.options["queue"]
    else:
        queue = args.queue or "default"
        jid = c.push(args.name, args.values, queue=queue, at=args.at, kwargs=args.keywords or None)
    if jid is None:
        sys.stderr.write("forkq: nothing pushed: a client middleware dropped it, or it is a "
                         "unique job whose twin is pending\n")
        return 1
    _emit(args, {"jid": jid, "queue": queue, "at": args.at},
          [jid if args.at is None else f"{jid} (due {_when(args.at)} UTC)"])  # UTC, as every table
    return 0


def _load_entries(args: argparse.Namespace) -> list:
    from . import cron
    from .cli import load_app
    modules = config.require_for_tools(args.require, args.config)
    if not modules:
        raise ConfigError("cron: give --require with the app's module or .py file that declares "
                          "the entries (as forkq start has it), or set FORKQ_REQUIRE")
    load_app(modules)
    return list(cron.ENTRIES.values())


def _cron(conn, args):
    import time
    from . import cron
    rows = cron.status(conn, args.entries, time.time())
    table = _table(["name", "schedule", "timezone", "job", "queue", "next due", "last pushed", "jid"],
                   [[r["name"], r["expression"], r["timezone"], r["job"], r["queue"],
                     _local(r["next_due_local"]), _local(r["last_pushed_local"]), r["last_jid"]]
                    for r in rows])
    return rows, table if rows else ["the app declares no periodic entries (forkq.periodic)"]


def _local(iso: str | None) -> str | None:
    return None if iso is None else iso.replace("T", " ")


def _args_text(job: dict | None) -> str:
    import json
    text = json.dumps(job.get("args"), default=str) if job else "(unreadable)"
    if job and "kwargs" in job:  # keyword arguments next to the positional ones
        text += " " + json.dumps(job["kwargs"], default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _progress_text(progress) -> str | None:
    """"1,200/2,000 (60%) importing", cut to fit a table row."""
    if progress is None:
        return None
    text = progress.describe()
    return text if len(text) <= 50 else text[:47] + "..."


def _enqueued_at(job: dict | None) -> float:
    from . import api
    return api.stamp((job or {}).get("enqueued_at")) or math.inf


def _busy(conn, args):
    import time
    from . import api, payload
    now = time.time()
    # run_at is whole seconds (Sidekiq's format): among jobs started in the same second,
    # the one enqueued first most likely started first
    jobs = sorted(api.running(conn), key=lambda j: (j.run_at or now, _enqueued_at(j.job)))
    data, rows = [], []
    for j in jobs:
        job = j.job or {}
        took = now - j.run_at if j.run_at else None
        name = payload.display_name(job) if job else None
        row = {"identity": j.identity, "thread": j.thread, "queue": j.queue, "jid": job.get("jid"),
               "class": name, "args": job.get("args"), "run_at": j.run_at, "running_for": took,
               "progress": j.progress.to_dict() if j.progress else None}
        if "kwargs" in job:
            row["kwargs"] = job["kwargs"]
        data.append(row)
        rows.append([j.identity, j.queue, job.get("jid"), name, _age(took), _progress_text(j.progress),
                     _args_text(j.job)])
    header = ["process", "queue", "jid", "class", "running", "progress", "args"]
    return data, _table(header, rows) if rows else ["no jobs running"]


def _set_command(conn, args: argparse.Namespace) -> int:
    from . import api, keys
    zset = api.SortedSet(conn, args.command)
    where = api.matching(klass=args.klass, queue=args.queue, jid=args.jid,
                         malformed=getattr(args, "malformed", False))
    if args.action == "list":
        import itertools
        entries = list(itertools.islice(zset.entries(where), args.limit))
        rows = [[_when(e.score), e.jid, e.klass, e.queue, _error(e)] for e in entries]
        table = _table(["when (UTC)", "jid", "class", "queue", "error"], rows) if rows else [
            f"no matching entries in {args.command}"]
        _emit(args, [e.to_dict() for e in entries], table)
        return 0
    if getattr(args, "malformed", False) and args.action in RUN_VERBS:
        sys.stderr.write(f"forkq: {args.action} --malformed: these entries are no runnable jobs; "
                         f"list them, or delete them\n")
        return 2
    action = {"retry": zset.retry_now, "retry-now": zset.retry_now, "run-now": zset.retry_now,
              "delete": zset.delete, "kill": zset.kill}[args.action]
    dead_before = api.dead(conn).size() if args.action == "kill" else 0
    if args.jid:
        entry = zset.find(args.jid)
        if entry is None:
            sys.stderr.write(f"forkq: no entry with jid {args.jid} in {args.command}\n")
            return 1
        count = action([entry])
        if count == 0 and args.action not in ("delete", "kill"):
            sys.stderr.write(f"forkq: could not {args.action} jid {args.jid}: it is no runnable job "
                             "(a malformed entry, no valid queue name, or NaN/Infinity in it; "
                             "see `list --json`)\n")
            return 1
    else:
        count = zset.apply(action, None if args.all else where)
    data: dict[str, object] = {"set": args.command, "action": args.action, "count": count}
    line = f"{args.action}: {count} entr{'y' if count == 1 else 'ies'} of {args.command}"
    if args.action == "kill":
        # the dead set is trimmed as Sidekiq trims it, so a big kill does not leave all it
        # moved there: say how many are gone rather than let the count promise them
        data["dropped"] = dropped = max(0, dead_before + count - api.dead(conn).size())
        line += " moved to dead"
        if dropped:
            line += (f", which keeps only its newest {keys.DEAD_MAX_JOBS - 1:,} entries (none older than "
                     f"{keys.DEAD_TIMEOUT_S // 86400} days): its {dropped:,} oldest were dropped")
    _emit(args, data, [line])
    return 0


def _queue_command(conn, args: argparse.Namespace) -> int:
    """`forkq queue NAME list|delete`: a queue's waiting jobs, as the set commands show theirs."""
    from . import api
    from .pause import check_queue
    try:
        check_queue(args.queue_name)
    except ValueError as exc:
        sys.stderr.write(f"forkq: {_printable(str(exc))}\n")
        return 2
    queue = api.Queue(conn, args.queue_name)
    name = _printable(args.queue_name)
    if args.jid is not None:
        found = queue.find(args.jid)
        entries = [found] if found is not None else []
    if args.action == "list":
        if args.jid is None:
            import itertools
            entries = list(itertools.islice(queue.entries(api.matching(klass=args.klass)), args.limit))
        else:
            entries = [e for e in entries if api.matching(klass=args.klass)(e)]
        stamps = [api.stamp((e.job or {}).get("enqueued_at")) for e in entries]
        rows = [[e.position, None if at is None else _when(at), e.jid,
                 e.klass if e.job is not None else "(unparseable entry)", _args_text(e.job)]
                for e, at in zip(entries, stamps)]
        table = _table(["position", "enqueued (UTC)", "jid", "class", "args"], rows) if rows else [
            f"no matching jobs wait on queue {name}"]
        _emit(args, [e.to_dict() for e in entries], table)
        return 0
    if args.jid is not None:
        if not entries:
            sys.stderr.write(f"forkq: no job with jid {_printable(args.jid)} waits on queue {name}\n")
            return 1
        count = queue.delete(entries)
    elif args.all:
        count = queue.clear()
    else:
        count = queue.apply(queue.delete, api.matching(klass=args.klass))
    line = f"delete: {count} job{'' if count == 1 else 's'} of queue {name}"
    if args.all:  # nothing stops workers: the jobs they took run as usual
        line += " (workers may have taken some meanwhile)"
    if queue.chains_cut:  # a cancel would have kept them, in dead
        line += (f"; {queue.chains_cut} of them carried the rest of a chain, whose later steps "
                 "will not run (forkq cancel parks a step in dead with them)")
    _emit(args, {"queue": args.queue_name, "action": "delete", "count": count,
                 "chains_cut": queue.chains_cut}, [line])
    return 0


def _when(score: float) -> str:
    from datetime import datetime, timezone
    try:
        return datetime.fromtimestamp(score, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return str(score)


def _error(entry) -> str:
    job = entry.job or {}
    if not job.get("error_class"):
        return "" if entry.job is not None else "(unparseable entry)"
    text = f"{job['error_class']}: {job.get('error_message', '')}"
    return text if len(text) <= 60 else text[:57] + "..."
