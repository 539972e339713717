"""Lua scripts, read from the .lua files beside this module and registered once per client."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import redis
from redis.commands.core import Script

_HERE = Path(__file__).parent


@cache
def source(name: str) -> str:
    return (_HERE / f"{name}.lua").read_text()


def load(client: redis.Redis, name: str) -> Script:
    # Script runs EVALSHA and reloads the body itself after NOSCRIPT (a restarted Redis).
    return client.register_script(source(name))
