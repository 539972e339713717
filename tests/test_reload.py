"""`forkq start --reload`: the watcher in-process, and one real master that reloads.

The master test runs `python -m forkq start --reload --processes 2` in a temp app directory
and edits its jobs.py the way a developer would; each job records, in Redis, the VERSION
of the code that ran it. Waiting is always a deadline (wait_until), never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from forkq import cli, reload
from helpers import forkq_command, wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent


# -- the watcher -----------------------------------------------------------------------------


def _touch(path: Path, text: str) -> None:
    """Write `text`, with an mtime past the last one: two writes in one coarse clock tick
    must still differ, as two saves seconds apart do."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    st = path.stat()
    if st.st_mtime_ns <= before:
        os.utime(path, ns=(st.st_atime_ns, before + 1_000_000))


@pytest.mark.timeout(10)
def test_the_watcher_sees_edits_deletions_and_new_py_files_but_not_editor_droppings(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 1\n")
    w = reload.Watcher([str(a), str(b)])
    assert w.changed() == []
    _touch(a, "x = 2\n")
    assert w.changed() == [str(a)]
    assert w.changed() == []                      # reported once
    for name in (".#b.py", "#b.py#", "b.py~", ".b.py.swp", "notes.txt"):
        (tmp_path / name).write_text("")
    assert w.changed() == []
    (tmp_path / "c.py").write_text("")
    assert w.changed() == [str(tmp_path / "c.py")]
    b.unlink()
    assert w.changed() == [str(b)]


@pytest.mark.timeout(10)
def test_a_file_saved_while_the_app_imported_counts_at_the_first_poll(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("x = 1\n")
    saved = a.stat().st_mtime
    late = reload.Watcher([str(a)], since=saved - 1)     # import began before the save
    assert late.due() and late.changed() == [str(a)]
    early = reload.Watcher([str(a)], since=saved + 1)    # import began after it
    assert not early.due() and early.changed() == []
    ahead = time.time_ns() + 3600 * 10**9                 # a clock an hour ahead: not "during"
    os.utime(a, ns=(ahead, ahead))
    assert reload.Watcher([str(a)], since=saved - 1).changed() == []


@pytest.mark.timeout(10)
def test_the_apps_files_are_those_under_the_working_directory_not_installed_code(tmp_path, monkeypatch):
    import json as stdlib_module

    import redis as installed_module
    app = tmp_path / "proj"
    (app / "pkg").mkdir(parents=True)
    (app / "pkg" / "__init__.py").write_text("")
    (app / "pkg" / "tasks.py").write_text("VALUE = 1\n")
    elsewhere = tmp_path / "lib"
    elsewhere.mkdir()
    (elsewhere / "extra_jobs_for_reload.py").write_text("VALUE = 2\n")
    monkeypatch.chdir(app)
    monkeypatch.setattr(reload, "_started", None)
    monkeypatch.syspath_prepend(str(app))
    monkeypatch.syspath_prepend(str(elsewhere))
    for name in ("pkg", "pkg.tasks", "extra_jobs_for_reload"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    __import__("pkg.tasks")
    __import__("extra_jobs_for_reload")
    files = reload.app_files(["pkg.tasks"])
    assert str(app / "pkg" / "tasks.py") in files and str(app / "pkg" / "__init__.py") in files
    assert str(elsewhere / "extra_jobs_for_reload.py") not in files   # not under a root
    assert os.path.realpath(stdlib_module.__file__) not in files
    assert os.path.realpath(installed_module.__file__) not in files
    # a --require path adds its directory as a root
    assert str(elsewhere / "extra_jobs_for_reload.py") in reload.app_files(
        [str(elsewhere / "extra_jobs_for_reload.py")])
