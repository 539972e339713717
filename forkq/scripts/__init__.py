"""Lua scripts, read from the .lua files beside this module and registered once per client."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import redis
from redis.commands.core import Script

_HERE = Path(__file__).parent


@cache
def source(name: str) -> str:
    """A script's text, with each `--#include NAME` line replaced by _NAME.lua (Redis runs
    every script alone: helpers shared by several are pasted in)."""
    text = (_HERE / f"{name}.lua").read_text()
    return re.sub(r"^--#include (\w+)$", lambda m: (_HERE / f"_{m.group(1)}.lua").read_text(),
                  text, flags=re.M)


def load(client: redis.Redis, name: str) -> Script:
    # Script runs EVALSHA and reloads the body itself after NOSCRIPT (a restarted Redis).
    return client.register_script(source(name))
