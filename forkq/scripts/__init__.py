"""Lua scripts, read from the .lua files beside this module and registered once per client."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import redis
from redis.client import Pipeline
from redis.commands.core import Script

_HERE = Path(__file__).parent


@cache
def source(name: str) -> str:
    """A script's text, with each `--#include NAME` line replaced by _NAME.lua (Redis runs
    every script alone: helpers shared by several are pasted in)."""
    return _expand((_HERE / f"{name}.lua").read_text())


def _expand(text: str) -> str:
    # included files may include others (_batch.lua pastes _batchttl.lua)
    return re.sub(r"^--#include (\w+)$", lambda m: _expand((_HERE / f"_{m.group(1)}.lua").read_text()),
                  text, flags=re.M)


class _Script(Script):
    """EVALSHA, then EVAL with the body after NOSCRIPT (a restarted Redis, SCRIPT FLUSH), as
    the claim does (wire.run_script).

    redis-py's Script answers NOSCRIPT with SCRIPT LOAD and a second EVALSHA: a Redis with
    SCRIPT renamed away (or an ACL user without it) refused the load, so the scheduler, the
    outcomes and the requeues failed for good after a restart, and a SCRIPT FLUSH between
    the load and the EVALSHA failed the call. EVAL needs neither, and caches the script."""

    def __call__(self, keys: Sequence[Any] | None = None, args: Iterable[Any] | None = None,
                 client: Any = None) -> Any:
        client = self.registered_client if client is None else client
        keys = list(keys or [])
        argv = (*keys, *(args or []))
        if isinstance(client, Pipeline):
            # the body itself: redis-py would queue EVALSHA and send SCRIPT EXISTS and LOAD
            # before the pipeline, which the Redis described above refuses too
            return client.eval(self.script, len(keys), *argv)
        try:
            return client.evalsha(self.sha, len(keys), *argv)
        except redis.exceptions.NoScriptError:
            return client.eval(self.script, len(keys), *argv)


def load(client: redis.Redis, name: str) -> Script:
    return _Script(client, source(name))
