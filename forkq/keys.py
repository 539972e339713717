"""Every Redis key forkq reads or writes, in one place.

The unprefixed names are Sidekiq's (so Sidekiq clients, its Web UI and forkq share
data); names under ``forkq:`` are forkq's own and never collide with Sidekiq Pro.
"""

QUEUES = "queues"
SCHEDULE = "schedule"
RETRY = "retry"
DEAD = "dead"
PROCESSES = "processes"
PROCESS_CLEANUP = "process_cleanup"
STAT_PROCESSED = "stat:processed"
STAT_FAILED = "stat:failed"

# forkq's registry of processes that own private in-flight structures: identity -> JSON
# {"queues": [...], "host": ..., "pid": ..., "master": ...}. A supervisor or another
# host finds every private structure through this hash, never through KEYS or SCAN.
OWNERS = "forkq:owners"
# Stray recovery (strays.py): a pass's SCAN cursor while one is under way, a key whose
# expiry is the rest until the next pass, identities seen holding private structures
# without an owners entry (identity -> JSON), and the lock one master holds per slice.
# None starts with "forkq:i" or "forkq:l", so the scan's MATCH never returns them.
STRAYS_CURSOR = "forkq:strays:cursor"
STRAYS_REST = "forkq:strays:rest"
STRAYS_SEEN = "forkq:strays:seen"
STRAYS_LOCK = "forkq:strays:lock"
CRASH_PREFIX = "forkq:crashes:"
# Jobs that were in flight in a process that died, waiting to run one at a time, each alone
# in its process, so a crash while one runs counts against that job only. One list per
# queue (see suspects()): apps sharing a Redis on different queues never see, wait for or
# run each other's suspects.
SUSPECTS_PREFIX = "forkq:suspects:"

# Sidekiq's dead_max_jobs and dead_timeout_in_seconds. DeadSet#kill trims with
# ZREMRANGEBYRANK dead 0 -dead_max_jobs, which removes down to dead_max_jobs - 1 entries:
# forkq makes the same call, so the set is the same size whichever side wrote last.
DEAD_MAX_JOBS = 10_000
DEAD_TIMEOUT_S = 180 * 24 * 3600
HEARTBEAT_TTL_S = 60
# How long an owner's alive key (see alive()) outlives its last heartbeat. Silence is read
# off this key's remaining TTL, so a --recovery-delay longer than this counts as this long.
ALIVE_TTL_S = 7 * 24 * 3600
STAT_DAY_TTL_S = 5 * 365 * 24 * 3600
# How long a process's flushed totals outlive its last heartbeat: far beyond any silence of
# a live process (a master kills one silent for --hang-timeout), and short enough that the
# keys of a whole forkq that died go away by themselves.
FLUSHED_TTL_S = 3600


# A job's kept outcome (`keep_result`): see result()
RESULT_PREFIX = "forkq:result:"
CHAIN_PREFIX = "forkq:chain:"
# a long chain's steps outlive a step's stay in dead (a retry from there goes on) and a
# month of retries before it
CHAIN_TTL_S = DEAD_TIMEOUT_S + 30 * 24 * 3600
# A batch's hash, and its ":jids" and ":failed" beside it: see batch()
BATCH_PREFIX = "forkq:batch:"
# The index of batches, for listing them: a sorted set, bid -> created_at. Written by the
# script that opens a batch, which also prunes it (forkq.batch.recent drops what it finds
# expired); at most BATCHES_MAX entries, the oldest leaving first.
BATCHES = "forkq:batches"
BATCHES_MAX = 10_000
# A rate limiter's key: see limiter()
LIMITER_PREFIX = "forkq:limiter:"
# Paused queues (pause.py): queue name -> JSON {"at": epoch s, "reason": ..., "by": ...}.
# Every process reads it at its heartbeat and claims nothing from the queues it names.
PAUSED = "forkq:paused"
# Cancellation requests (cancel.py): jid -> JSON {"at": epoch s, "by": ..., "reason": ...}.
# An operator's cancel writes one; a worker whose heartbeat finds one for a job it runs
# interrupts that job, and the write that puts the job in `dead` deletes the request.
CANCEL = "forkq:cancel"

CRON_PREFIX = "forkq:cron:"
# A periodic entry's hash outlives its last push or boot by this long: the key of an entry
# removed from the app goes away by itself, and one that comes back after it is new again
# (owes nothing from before), which is also what a yearly entry's next push sees in time
CRON_TTL_S = 400 * 24 * 3600


def queue(name: str) -> str:
    return "queue:" + name


def workers(identity: str) -> str:
    """Running-jobs hash as Sidekiq 6.4 names it."""
    return identity + ":workers"


def work(identity: str) -> str:
    """Running-jobs hash as Sidekiq 6.5+ (and its Web UI) names it."""
    return identity + ":work"


def signals(identity: str) -> str:
    return identity + "-signals"


def inflight(identity: str) -> str:
    """Hash of this process's fetched, unacknowledged jobs: token -> "QUEUE\\nPAYLOAD"."""
    return "forkq:inflight:" + identity


def alive(identity: str) -> str:
    """An owner's clock for orphan recovery, set again with ALIVE_TTL_S at each heartbeat:
    the time since its last beat is ALIVE_TTL_S less its remaining TTL, counted by Redis.
    The heartbeat's `beat` field is the owner's own clock, and a host whose clock runs
    behind another's looks silent to it (or, ahead, alive long after it died). Sidekiq's
    heartbeat hash cannot serve: it expires 60 s after the last beat, and a longer
    --recovery-delay would then have nothing to go by."""
    return "forkq:alive:" + identity


def suspects(queue_name: str) -> str:
    """A queue's crash suspects, plain payloads as on the queue; RPOP takes the next one."""
    return SUSPECTS_PREFIX + queue_name


def landing(identity: str, queue_name: str) -> str:
    """Private list a blocking wait moves a job into before the fetch script claims it."""
    return f"forkq:landing:{identity}:{queue_name}"


def flushed(identity: str) -> str:
    """Hash of the processed and failed totals a process has added to the stats so far."""
    return "forkq:flushed:" + identity


def stat_day(name: str, day: str) -> str:
    return f"stat:{name}:{day}"


def flush_stats(identity: str, day: str) -> list[str]:
    """The keys of the flush_stats script, for a process and a UTC day (YYYY-MM-DD)."""
    return [flushed(identity), STAT_PROCESSED, STAT_FAILED,
            stat_day("processed", day), stat_day("failed", day)]


def cron(entry_name: str) -> str:
    """A periodic entry's hash: `pushed` (its latest due time pushed, epoch seconds), `jid`
    and `pushed_at` of that push, `since` (no due time at or before it is owed: when the
    entry was first seen, or its schedule changed) and `spec` (the schedule it was seen
    with). Shared by every process that runs the app: its push script compares and sets
    `pushed`, so each due time is pushed once across the fleet."""
    return CRON_PREFIX + entry_name


def result(jid: str) -> str:
    """A `keep_result` job's outcome: a list of one JSON element (see forkq.results),
    expiring keep_result seconds after it was written."""
    return RESULT_PREFIX + jid


def chain(jid: str) -> str:
    """A long chain's later steps (forkq.chains): a list of their payloads, pushed with its
    first step (jid `jid`), read by index as each step succeeds, deleted once its last
    step is pushed; it expires CHAIN_TTL_S after the chain last moved."""
    return CHAIN_PREFIX + jid


def batch(bid: str) -> str:
    """A batch's hash (description, total, sealed, callbacks...); "KEY:jids" is the set of
    its jobs that have not succeeded, "KEY:failed" their last failures (forkq.batch,
    scripts/_batch.lua, whose after-success actions know a batch by this prefix)."""
    return BATCH_PREFIX + bid


def limiter(name: str, kind: str) -> str:
    """A rate limiter's state: a sorted set of leases (concurrent) or entries (window), or
    a hash of its window and count (bucket); see forkq.limiter."""
    return f"{LIMITER_PREFIX}{name}:{kind}"
