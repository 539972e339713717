"""Loaded into a forkq master with `--require` by bench/claims.py: every child records
when each of its claim round trips began and ended, and appends them to
$FORKQ_BENCH_TRACE/claims.PID every 100 claims.

It wraps a private method of forkq's fetcher, so it belongs to the benchmark only: what
it measures is where a child's time goes, not how fast forkq is (the wrapper and its
writes cost the child a little).
"""

import os
import time

from bench.jobs import noop  # noqa: F401  (registers the job the benchmark runs)
from forkq import fetch

_DIR = os.environ["FORKQ_BENCH_TRACE"]
_claim = fetch.ReliableFetch._claim
_spans: list[str] = []


def _traced(self, keys_, argv):
    began = time.monotonic_ns()
    try:
        return _claim(self, keys_, argv)
    finally:
        _spans.append(f"{began} {time.monotonic_ns()}\n")
        if len(_spans) >= 100:
            with open(os.path.join(_DIR, f"claims.{os.getpid()}"), "a") as out:
                out.writelines(_spans)
            _spans.clear()


fetch.ReliableFetch._claim = _traced
