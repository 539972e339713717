"""An app whose on_fork hook always raises: every child dies as it starts (crash loop)."""

import forkq


@forkq.on_fork
def open_widget_cache(slot):
    raise RuntimeError(f"widget cache unavailable in slot {slot}")


@forkq.job(name="broken.noop")
def noop():
    pass
