"""`forkq start --reload`: notice that the app's source changed, and start it again.

What is watched: the source file of every module the master has imported (by the time it
forks) that lies under the working directory or the directory of a `--require` path, and
not under the standard library or a site-packages directory (a virtualenv inside the
project stays unwatched), plus the TOML file the settings came from. A new `.py` file in
a directory holding a watched file counts as a change too: one stat of the directory per
poll, and its listing is read only when the directory's own mtime moved (an editor's swap
or backup file moves it and is then ignored). New subdirectories do not count.

Polling, not inotify: no dependency, and the master's loop wakes twice a second anyway.
One poll is one stat per file and directory; a poll that took long (a few thousand files
on a slow disk) spaces the next out, so polling never takes more than about 5% of a core.

The restart itself is an exec of the same command line in the same process (`reexec`),
with the environment and working directory forkq started with: the pid, the pidfile and a
terminal's Ctrl-C stay the same. The caller stops its workers first, the normal way.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import site
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterable

from . import logs

log = logs.get("forkq.reload")

POLL_S = 1.0
# a poll may take at most this share of the time between polls (see Watcher.due)
MAX_SHARE = 0.05

# What forkq was started with, before the app's import could change it (an app that sets
# DJANGO_SETTINGS_MODULE or chdirs at import must find things as they were at the next start)
_started: tuple[dict[str, str], str] | None = None
# files to watch that no module is: the settings file
_extra: list[str] = []


def remember_start(config_file: str | None = None) -> None:
    """Note the environment and working directory to exec with, and the settings file to
    watch; call before the app imports."""
    global _started
    _started = (dict(os.environ), os.getcwd())
    _extra[:] = [os.path.realpath(config_file)] if config_file else []


def watcher_for(requires: list[str], since: float, failed: BaseException | None = None) -> Watcher:
    """The Watcher of a start: the app's files as imported, with those a failed import went
    through, the settings file, the --require files (one that does not exist yet counts
    when it appears), and new .py files in the roots."""
    cwd = _started[1] if _started else os.getcwd()
    named = [os.path.realpath(os.path.join(cwd, r)) for r in requires if r.endswith(".py")]
    extra = [*_extra, *(failed_import_files(failed) if failed is not None else [])]
    files = sorted(set(app_files(requires, extra)) | set(named) | set(_extra))
    return Watcher(files, since=since, dirs=roots(requires))


def roots(requires: Iterable[str], cwd: str | None = None) -> list[str]:
    """The directories whose files are the app's: the working directory and the directory of
    each --require given as a path."""
    cwd = _started[1] if cwd is None and _started else (cwd or os.getcwd())
    found = [os.path.realpath(cwd)]
    for item in requires:
        if item.endswith(".py") or os.sep in item:
            found.append(os.path.dirname(os.path.realpath(os.path.join(cwd, item))))
    return sorted(set(found))


def _installed() -> list[str]:
    """Directories of code that is not the app's: the standard library and site-packages."""
    dirs = set()
    for scheme_key in ("stdlib", "platstdlib", "purelib", "platlib"):
        for vars_ in (None, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
            path = sysconfig.get_path(scheme_key, vars=vars_)
            if path:
                dirs.add(path)
    try:
        dirs.update(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        dirs.add(site.getusersitepackages())
    return sorted({os.path.realpath(d) for d in dirs})


def _under(path: str, dirs: Iterable[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def app_files(requires: Iterable[str], extra: Iterable[str] = ()) -> list[str]:
    """The source files to watch: imported modules' files under roots() and outside the
    installed code, and `extra` files (a config file, the files a failed import named)
    that lie under roots() too."""
    inside, outside = roots(requires), _installed()
    files = set()
    candidates = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    for name in [*candidates, *extra]:
        if not isinstance(name, str) or not name:
            continue
        path = os.path.realpath(name)
        if _under(path, inside) and not _under(path, outside) and os.path.isfile(path):
            files.add(path)
    return sorted(files)


def failed_import_files(exc: BaseException) -> list[str]:
    """The files a failed import went through, and the one a SyntaxError names: watched,
    besides what did import, while forkq waits for the edit that fixes it."""
    names = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # the cause's file, if it is another
        seen.add(id(exc))
        if isinstance(exc, SyntaxError) and exc.filename:
            names.append(exc.filename)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return names


Signature = tuple[int, int, int]  # mtime_ns, size, inode: an atomic save renames a new inode in


def _signature(path: str) -> Signature | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _py_names(directory: str) -> frozenset[str]:
    # not an editor's lock or backup (Emacs's .#jobs.py)
    try:
        return frozenset(n for n in os.listdir(directory)
                         if n.endswith(".py") and not n.startswith((".", "#")))
    except OSError:
        return frozenset()


class Watcher:
    """Which of the files changed since it was made (or since `since`, a time.time() from
    before they were imported: a file saved while the import ran counts at the first poll)."""

    def __init__(self, files: Iterable[str], since: float | None = None,
                 dirs: Iterable[str] = ()) -> None:
        self.files = {path: _signature(path) for path in files}
        self.dirs: dict[str, tuple[int | None, frozenset[str]]] = {}
        for directory in sorted({os.path.dirname(p) for p in self.files} | set(dirs)):
            self.dirs[directory] = (self._dir_mtime(directory), _py_names(directory))
        # saved after `since` and not in the future: a file whose clock runs ahead (a mount
        # from a host with another clock) would otherwise restart every new master at once
        floor, now = (None if since is None else int(since * 1e9)), time.time_ns()
        self.early = sorted(p for p, sig in self.files.items()
                            if floor is not None and sig is not None and floor <= sig[0] <= now)
        self.interval = POLL_S
        self.last_cost = 0.0
        self._next = time.monotonic() + (0 if self.early else POLL_S)

    @staticmethod
    def _dir_mtime(directory: str) -> int | None:
        try:
            return os.stat(directory).st_mtime_ns
        except OSError:
            return None

    def due(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self._next

    def until_due(self) -> float:
        """Seconds until the next poll is due (0 when it is)."""
        return max(0.0, self._next - time.monotonic())

    def changed(self) -> list[str]:
        """Poll now: the changed, deleted or new files, sorted (empty: nothing changed)."""
        started = time.monotonic()
        out = set(self.early)
        self.early = []
        for path, sig in self.files.items():
            now_sig = _signature(path)
            if now_sig != sig:
                out.add(path)
                self.files[path] = now_sig
        for directory, (mtime, names) in self.dirs.items():
            now_mtime = self._dir_mtime(directory)
            if now_mtime == mtime:
                continue
            now_names = _py_names(directory)
            out.update(os.path.join(directory, n) for n in sorted(now_names - names))
            self.dirs[directory] = (now_mtime, now_names)
        self.last_cost = time.monotonic() - started
        # a slow poll spaces the next out: polling stays under MAX_SHARE of a core
        self.interval = max(POLL_S, self.last_cost / MAX_SHARE)
        self._next = time.monotonic() + self.interval
        return sorted(out)

    def __len__(self) -> int:
        return len(self.files)


def shown(paths: list[str], limit: int = 5) -> str:
    """The changed files for a log line: relative to the working directory when under it."""
    base = _started[1] if _started else os.getcwd()
    names = [os.path.relpath(p, base) if _under(p, [os.path.realpath(base)]) else p for p in paths]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def wait_for_change(watcher: Watcher) -> list[str]:
    """Block until a watched file changes (the dev loop after a broken edit); returns them.
    A stop signal ends the wait through the handler the caller has installed."""
    while True:
        time.sleep(watcher.until_due())
        changed = watcher.changed()
        if changed:
            return changed


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


# as long as an exit gives them (cli.EXIT_GRACE_S)
ATEXIT_GRACE_S = 2.0


def _exec_after(grace: float, argv: list[str], environ: dict[str, str], cwd: str,
                stopped: Callable[[], bool]) -> threading.Event:
    """Exec from a thread of its own `grace` s from now, unless the main thread's exec
    comes first (it ends this thread) or the returned event is set (that exec failed).
    Start it with the stop signals blocked: the thread keeps them so, and the new process
    gets them blocked and pending, as from the main thread's exec."""
    called_off = threading.Event()

    def cut_short() -> None:
        if called_off.wait(grace):
            return
        log.warning("the app's atexit handlers are still running; restarting without them",
                    waited_s=grace)
        logs.flush_all()
        if stopped():
            # a stop seen meanwhile (see reexec) is made pending in this thread, which
            # blocks it: it stays so across the exec, and the new run ends at its start
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        os.chdir(cwd)
        os.execve(sys.executable, argv, environ)

    threading.Thread(target=cut_short, name="forkq-reload-exit", daemon=True).start()
    return called_off


def reexec(stop_pending: Callable[[], bool] | None = None) -> None:
    """Replace this process with a new run of the same command: same pid, argv, and the
    environment and working directory forkq started with. Does not return but when a stop
    signal came in meanwhile (`stop_pending()` says so, or one arrived while the app's
    atexit handlers ran): then there is nothing to restart, and once the handlers that
    were in place are back, such a signal is raised again for them to act on (a master's
    trap writes it to its self-pipe; the wait for a fixed edit ends, as a stop there does).

    A stop signal would be lost between the last look and the new process's handlers
    (or, before them, end it by default: Ctrl-C printed a KeyboardInterrupt traceback),
    so both are blocked around the looks and the exec: the exec keeps them blocked and
    pending, and cli.start unblocks them once its handlers are in place."""
    environ, cwd = _started if _started else (dict(os.environ), os.getcwd())
    logs.flush_all()
    # orig_argv: the interpreter's own command line (`python -m forkq ...`, the `forkq`
    # script, `python -c ...`), with any -X or -W options
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    seen: list[int] = []

    def hold(signum: int, frame: object) -> None:
        seen.append(signum)

    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # While the handlers run, a stop is only noted. The handler in place may raise (the
    # wait for a fixed edit's does): raised inside an atexit handler, the exception was
    # printed and dropped with the rest of that handler, and the stop lost
    before = {sig: signal.signal(sig, hold) for sig in STOP_SIGNALS}
    # A handler may put a signal handler of its own in place of `hold` (restoring the one
    # it found at import: Ctrl-C then raised KeyboardInterrupt in it, printed and dropped).
    # A master's wakeup pipe sees such a stop all the same (stop_pending); without one (the
    # wait for a fixed edit), a pipe of ours does: it is written whatever Python handler runs
    woken = _wakeup_pipe()
    closing = threading.Lock()  # the grace thread may look while the finally closes it

    def stopped() -> bool:  # the master's look first: it logs why it exits
        with closing:
            if woken is not None:
                seen.extend(_stops_in(woken[0]))
        return (stop_pending is not None and stop_pending()) or bool(seen)

    cut_short = None
    try:
        if stopped():
            return
        # an exec skips what an exit runs: an app's atexit handlers (stopping a process or
        # a thread pool it started at import, flushing a client) would never run, and what
        # they clean up would be orphaned by the new run, once per reload. They get what an
        # exit gives them: one that hangs would hold the restart for as long as it hung.
        # They run where the app left the process, as at an exit (a relative socket or lock
        # file it removes is its own), and the exec goes back to where forkq began
        cut_short = _exec_after(ATEXIT_GRACE_S, argv, environ, cwd, stopped)
        # and with the stop signals unblocked, as at an exit: a process a handler starts
        # inherits the mask, and one started with them blocked ignored TERM and Ctrl-C
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        _forks_in_handlers(True)
        try:
            atexit._run_exitfuncs()
        finally:
            _forks_in_handlers(False)
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        # a stop sent while the handlers ran: `hold` saw it, or, taken by a thread of the
        # app's, the master's trap wrote it to its self-pipe, read by stop_pending
        if stopped():
            return
        os.chdir(cwd)
        os.execve(sys.executable, argv, environ)
    finally:  # not exec'd: a signal held meanwhile is handled here, by the handler it found
        if cut_short is not None:
            cut_short.set()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a pending one: to `hold`
        with closing:
            if woken is not None:
                signal.set_wakeup_fd(-1)
                seen.extend(_stops_in(woken[0]))
                for fd in woken:
                    os.close(fd)
                woken = None
        for sig, handler in before.items():
            if handler is not None:  # None: not set from Python, and cannot be put back
                signal.signal(sig, handler)
        if seen:
            signal.raise_signal(seen[0])


_in_handlers = False   # reexec is running the app's atexit handlers
_fork_hooks = False    # the hooks below are registered (once: a hook stays for good)
_forking = threading.local()  # the forking thread's mask, while it forks


def _forks_in_handlers(running: bool) -> None:
    global _in_handlers, _fork_hooks
    if not _fork_hooks:
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork,
                            after_in_child=_plain_after_fork)
        _fork_hooks = True
    _in_handlers = running


def _before_fork() -> None:
    # blocked across the fork: a stop sent to the new process before its hook has run
    # waits for the handling that hook gives it, instead of meeting `hold`
    if _in_handlers:
        _forking.mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _after_fork() -> None:
    mask = getattr(_forking, "mask", None)
    if mask is not None:
        _forking.mask = None
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _plain_after_fork() -> None:
    """In a process forked while the atexit handlers run (multiprocessing's fork start
    method): a plain Python process's stop signals. It kept `hold`, which only notes a stop
    (terminate() did nothing: it outlived the handler, orphaned), and the wakeup fd, a pipe
    it shares with forkq's process: its own TERM read there as a stop of forkq's, which
    exited instead of starting again."""
    global _in_handlers
    if not _in_handlers:
        return
    _in_handlers = False
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _after_fork()  # a stop sent meanwhile ends it now, as by default


def _wakeup_pipe() -> tuple[int, int] | None:
    """A non-blocking pipe made this process's signal wakeup fd, or None (and nothing
    changed) when it has one already (a master's, which its stop_pending reads) or no
    pipe can be had (`hold` alone notes a stop then)."""
    old = signal.set_wakeup_fd(-1)
    if old != -1:
        signal.set_wakeup_fd(old)
        return None
    try:
        r, w = os.pipe()  # not inherited: an exec closes it
    except OSError:
        return None
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    return r, w


def _stops_in(fd: int) -> list[int]:
    """The stop signals a wakeup pipe carried since it was last read."""
    found = []
    while True:
        try:
            data = os.read(fd, 256)
        except BlockingIOError:
            return found
        if not data:
            return found
        found += [signum for signum in data if signum in STOP_SIGNALS]
