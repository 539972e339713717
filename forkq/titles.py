"""Process titles: the long one `ps -f` shows, and the short kernel name (`comm`).

setproctitle writes the title into the kernel's `comm` too (its first 15 bytes), and a
`comm` with spaces breaks every reader of /proc/PID/stat that splits on spaces. CPython
3.12+ is one: os.fork() takes the 20th field as the thread count, and with the title's
spaces it read the priority (20) instead, so a single-threaded master warned at each
replacement fork that it was multi-threaded (on a CPython whose -W error makes that
warning raise, python/cpython#135427, the fork would fail in the master after the child
was made). So after each title the `comm` is set back to a name without spaces; that
name is what `ps -o comm`, `top` and `pgrep forkq` show.
"""

from __future__ import annotations

import setproctitle

MASTER_NAME = "forkq-master"
CHILD_NAME = "forkq-child"


def set_title(title: str, name: str) -> None:
    """Show `title` as this process's command line and `name` (15 bytes at most, no
    spaces) as its kernel name. Call it from the main thread: the kernel name that
    /proc/PID/stat reports is the main thread's."""
    setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(name)
