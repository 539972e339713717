"""Async jobs for tests/test_async_jobs.py's master test, loaded with --require.

Records go to sup:events as supervised_jobs.record writes them (its jobs and on_fork
hook come along)."""

import asyncio
import threading

import forkq
from tests.apps.supervised_jobs import record


@forkq.job(name="aio.whoami", retry=0)
async def whoami(tag):
    await asyncio.sleep(0)
    record("done", tag, jid=forkq.current_job()["jid"], thread=threading.current_thread().name)


@forkq.job(name="aio.limited", retry=1, time_limit=0.3)
async def limited(tag):
    record("start", tag)
    try:
        await asyncio.sleep(30)
    finally:
        record("cancelled", tag)
