"""An app whose on_fork hook fails the first start of each slot (a dependency that is slow
to come up), then succeeds: FLAKY_DIR holds a marker per slot that has failed once."""

import os

import forkq


@forkq.on_fork
def connect_widget_cache(slot):
    marker = os.path.join(os.environ["FLAKY_DIR"], f"slot{slot}")
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError(f"widget cache not up yet in slot {slot}")


@forkq.job(name="flaky.noop")
def noop():
    pass
