"""A preloaded app for bench/memory.py: a few heavy imports and a table built at import time."""

import asyncio  # noqa: F401
import decimal  # noqa: F401
import email.mime.multipart  # noqa: F401
import http.server  # noqa: F401
import sqlite3  # noqa: F401
import unittest  # noqa: F401
import xml.dom.minidom  # noqa: F401

import hypothesis  # noqa: F401
import yaml  # noqa: F401

import forkq

# data an app might load once at boot (a lookup table, parsed config, a model)
LOOKUP = {f"key-{i}": (i, str(i) * 8, [i, i + 1]) for i in range(300_000)}


@forkq.job(queue="mem")
def touch(i: int) -> int:
    return LOOKUP[f"key-{i % 300_000}"][0]
