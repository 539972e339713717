"""Test helpers: polling with a deadline, free ports, a real redis-server, Ruby Sidekiq.

Everything here talks to real processes. Nothing is faked: RedisServer runs
the `redis-server` binary on a loopback port of its own, and SidekiqRuby runs
Debian's Ruby Sidekiq 6.4.1 (`apt-get install ruby-sidekiq`) against it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

REPO_ROOT = Path(__file__).resolve().parent.parent
INTEROP_DIR = Path(__file__).resolve().parent / "interop"

REDIS_MISSING = (
    "redis-server is not on PATH. The tests need a real Redis: "
    "install it with `apt-get install -y redis-server` (.ci/run does this)."
)


def wait_until(predicate, timeout=10.0, interval=0.01, message=""):
    """Call predicate() until it returns something truthy; return that value.

    Raises AssertionError naming `message` and the last value seen when
    `timeout` seconds pass first. An exception from predicate() propagates.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {message or predicate!r}; "
                f"last value: {value!r}"
            )
        time.sleep(interval)


def stop_gracefully(proc: subprocess.Popen, timeout: float = 40) -> int:
    """SIGTERM a forkq started in its own session and return its exit code; past `timeout`
    seconds, SIGKILL its whole process group (the code is then -9)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


# Where forkq holds the constants tests set: settings defines the stop-time ones, and the
# modules that import them by name have copies of their own, each set too
_CONSTANT_MODULES = ("forkq.settings", "forkq.manager", "forkq.worker", "forkq.supervisor", "forkq.metrics",
                     "forkq.cli")


def forkq_command(*args: str, constants: dict[str, float] | None = None) -> list[str]:
    """The argv that runs `python -m forkq ARGS`; with `constants` ({"STOP_PATIENCE_S": 1.5}),
    one that runs the same CLI after setting those module constants wherever forkq holds
    them: a monkeypatch of that process (its children are forked from it and keep them),
    for tests whose time goes into waiting out a constant that no option sets."""
    if not constants:
        return [sys.executable, "-m", "forkq", *args]
    code = (
        "import importlib, sys\n"
        f"mods = [importlib.import_module(m) for m in {_CONSTANT_MODULES!r}]\n"
        f"for name, value in {constants!r}.items():\n"
        "    held = [m for m in mods if hasattr(m, name)]\n"
        "    assert held, f'no forkq module holds {name}'\n"
        "    for m in held:\n"
        "        setattr(m, name, value)\n"
        "from forkq.cli import main\n"
        "sys.exit(main())\n")
    return [sys.executable, "-c", code, *args]


def json_lines(path) -> list[dict]:
    """The JSON lines of a log file (`--log-format json`), skipping any other line."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # looked up here: a preexec_fn should not import or allocate
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    """preexec_fn: have Linux SIGKILL the child when the thread that started it ends.

    Keeps a hung or killed pytest from leaving redis-server / sidekiq behind.
    Linux ties this to the *thread*: start long-lived servers from the main
    thread (fixtures do), not from a short-lived helper thread.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _tail(path, lines=30):
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _wait_exit(proc, timeout):
    """Wait for a Popen to exit; return its code, or None if it is still alive."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _log_file(log_path, prefix):
    """(path, owned): the given log path, or a new temp file we may delete later."""
    if log_path:
        return Path(log_path), False
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(fd)
    return Path(path), True


def _stop_and_tidy(process, exc_type):
    """Context-manager exit for SidekiqServer / ForkqWorker.

    Stops the process (SIGKILL if SIGTERM does not work); deletes a temp log
    we made only when all went well, so a failure's log stays for reading.
    """
    clean = False
    try:
        clean = process.stop() == 0 and exc_type is None
    finally:
        if process.proc and process.proc.poll() is None:
            os.kill(process.proc.pid, signal.SIGKILL)
            process.proc.wait()
        if clean and process._own_log:
            process.log_path.unlink(missing_ok=True)


class RedisServer:
    """A private redis-server on 127.0.0.1, with its own directory and AOF.

    `--appendonly yes` makes stop()/kill() followed by start() (or restart())
    come back with the data, on the same port and directory.

        with RedisServer() as server:
            server.client().set("k", "v")
            server.restart()
            assert server.client().get("k") == b"v"
    """

    START_TIMEOUT = 10.0
    STOP_TIMEOUT = 10.0

    def __init__(self, port=None, dir=None, binary=None):
        self.binary = binary or shutil.which("redis-server")
        if not self.binary:
            raise RuntimeError(REDIS_MISSING)
        self._port_given = port is not None
        self.port = port or free_port()
        self._own_dir = dir is None
        self.dir = Path(dir) if dir else Path(tempfile.mkdtemp(prefix="forkq-redis-"))
        self.log_path = self.dir / "redis.log"
        self.proc = None
        self.paused = False
        self._started_once = False

    # -- facts ----------------------------------------------------------

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    @property
    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def client(self, **kwargs):
        """A new redis.Redis for this server (bytes replies unless told otherwise)."""
        kwargs.setdefault("decode_responses", False)
        return redis.Redis(host="127.0.0.1", port=self.port, db=0, **kwargs)

    def log_tail(self, lines=30):
        return _tail(self.log_path, lines)

    # -- lifecycle ------------------------------------------------------

    def _command(self):
        return [
            self.binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes",
            "--daemonize", "no",
            "--logfile", "",  # log to stdout, which goes to redis.log
        ]

    def start(self):
        """Start redis-server and return once it answers PING (10 s deadline)."""
        if self.running:
            raise RuntimeError(f"redis-server already running on port {self.port}")
        # A port picked by free_port() can be taken by someone else before we
        # bind it; on the very first start only, pick another one and retry.
        attempts = 1 if (self._port_given or self._started_once) else 3
        for attempt in range(attempts):
            try:
                self._start_once()
            except _AddressInUse:
                if attempt == attempts - 1:
                    raise RuntimeError(
                        f"redis-server could not bind 127.0.0.1:{self.port}:\n{self.log_tail()}"
                    ) from None
                self.port = free_port()
            else:
                self._started_once = True
                return self

    def _start_once(self):
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                start_new_session=True,  # Ctrl-C in a terminal goes to pytest, not redis
                preexec_fn=_die_with_parent,
            )
        self.paused = False
        # No retries: one probe must not outlive the deadline by itself.
        client = self.client(socket_timeout=0.5, socket_connect_timeout=0.5,
                             retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + self.START_TIMEOUT
        try:
            while True:
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if self.proc.poll() is not None:
                    self.proc = None
                    with open(self.log_path, "rb") as f:
                        f.seek(log_start)
                        this_run = f.read().decode(errors="replace")
                    if "Address already in use" in this_run:
                        raise _AddressInUse()
                    raise RuntimeError(f"redis-server exited at start:\n{this_run[-3000:]}")
                if time.monotonic() >= deadline:
                    self.kill()
                    raise RuntimeError(
                        f"redis-server did not answer PING within {self.START_TIMEOUT:g}s:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(0.01)
        finally:
            client.close()

    def stop(self):
        """SIGTERM and wait for exit. Redis flushes the AOF first, so data is kept."""
        if not self.running:
            self.proc = None
            return
        if self.paused:
            self.resume()  # a stopped process cannot act on SIGTERM
        os.kill(self.proc.pid, signal.SIGTERM)
        if _wait_exit(self.proc, self.STOP_TIMEOUT) is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None
            raise RuntimeError(
                f"redis-server ignored SIGTERM for {self.STOP_TIMEOUT:g}s; killed it:\n"
                f"{self.log_tail()}"
            )
        self.proc = None

    def kill(self):
        """SIGKILL and reap. Whatever reached the AOF survives a later start()."""
        if self.running:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        self.paused = False

    def restart(self):
        """stop() then start() on the same port and directory."""
        self.stop()
        return self.start()

    def pause(self):
        """SIGSTOP: the server keeps its socket but answers nothing until resume()."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self):
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def close(self):
        """Stop the server (killing it if it will not stop) and delete its directory."""
        if self._own_dir:
            # its data goes with the directory: nothing to flush, and a SIGTERM costs a
            # turn of redis-server's 10 Hz cron (~0.1 s) in every test's teardown
            self.kill()
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        try:
            self.stop()
        except RuntimeError:
            pass
        finally:
            self.kill()

    def __enter__(self):
        if not self.running:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "paused" if self.paused else ("running" if self.running else "stopped")
        return f"<RedisServer {self.url} pid={self.pid} {state} dir={self.dir}>"


class _AddressInUse(Exception):
    pass


class _Proxy:
    """A loopback TCP proxy to a Redis port: each connection gets two pump threads, one per
    direction, that subclasses' _forward lets data through (or not)."""

    def __init__(self, port: int) -> None:
        self._target = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            marked = threading.Event()  # per connection: its request held a marker
            for src, dst, replies in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, replies, marked),
                                 daemon=True).start()

    def _pump(self, src, dst, replies, marked) -> None:
        try:
            while data := src.recv(65536):
                if not self._forward(data, replies, marked):
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _forward(self, data: bytes, replies: bool, marked: threading.Event) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()


class CommandCutter(_Proxy):
    """A proxy that, once a client sends a request holding `marker` (say b"LPUSH"),
    swallows that connection's next reply and closes it: the command ran, and its client
    never hears so. Other connections through it (a sentinel's pings) pass untouched.
    Made with `armed=False` it cuts nothing until `armed` is set; with the empty marker it
    then cuts the next reply on any connection (one already blocked in a command, say).
    It cuts once."""

    def __init__(self, port: int, marker: bytes = b"", armed: bool = True) -> None:
        self._marker = marker
        self.armed = threading.Event()
        if armed:
            self.armed.set()
        self.cut = threading.Event()
        super().__init__(port)

    def _forward(self, data: bytes, replies: bool, marked: threading.Event) -> bool:
        if not replies and self._marker in data:
            marked.set()
        elif replies and marked.is_set() and self.armed.is_set() and not self.cut.is_set():
            self.cut.set()
            return False
        return True


class CommandHolder(_Proxy):
    """A proxy that holds back, until `release` is set, the first request holding
    `marker` (and what its connection sends after it): a command stuck on its way to a
    frozen server, while every other connection goes through. It holds nothing while
    `marker` is None."""

    def __init__(self, port: int, marker: bytes | None = None) -> None:
        self.marker = marker
        self.holding = threading.Event()
        self.release = threading.Event()
        super().__init__(port)

    def _forward(self, data: bytes, replies: bool, marked: threading.Event) -> bool:
        marker = self.marker
        if not replies and marker is not None and marker in data and not self.holding.is_set():
            self.holding.set()
            self.release.wait()
        return True

    def close(self) -> None:
        self.release.set()
        super().close()


class ReplyHolder(_Proxy):
    """A proxy that holds back, until `release` is set, the reply to the first request
    holding `marker`: the command has run in Redis, and its client is still waiting."""

    def __init__(self, port: int, marker: bytes) -> None:
        self.marker = marker
        self.holding = threading.Event()
        self.release = threading.Event()
        super().__init__(port)

    def _forward(self, data: bytes, replies: bool, marked: threading.Event) -> bool:
        if not replies and self.marker in data:
            marked.set()
        elif replies and marked.is_set() and not self.holding.is_set():
            self.holding.set()
            self.release.wait()
        return True

    def close(self) -> None:
        self.release.set()
        super().close()


# ---------------------------------------------------------------------------
# Ruby Sidekiq 6.4.1
# ---------------------------------------------------------------------------


def sidekiq_ruby_problem():
    """None if Ruby and the sidekiq gem are usable, else why not."""
    ruby = shutil.which("ruby")
    if not ruby:
        return "ruby is not on PATH"
    try:
        out = subprocess.run(
            [ruby, "-e", 'require "sidekiq"; print Sidekiq::VERSION'],
            capture_output=True, text=True, timeout=60,
        )
    except subprocess.TimeoutExpired:
        return "`ruby -e 'require \"sidekiq\"'` hung for 60 s"
    if out.returncode != 0:
        detail = out.stderr.strip()[-300:] or f"exit status {out.returncode}"
        return f"`ruby -e 'require \"sidekiq\"'` failed: {detail}"
    return None


def find_sidekiq_executable(ruby):
    """Path of the `sidekiq` server script.

    Debian's ruby-sidekiq puts a RubyGems wrapper at /usr/bin/sidekiq; the real
    script is the gem's bin/sidekiq (found with Gem.bin_path). Either is run
    as `ruby PATH ...`.
    """
    on_path = shutil.which("sidekiq")
    if on_path:
        return on_path
    out = subprocess.run(
        [ruby, "-e", 'print Gem.bin_path("sidekiq", "sidekiq")'],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return out.stdout.strip()


class SidekiqRuby:
    """Paths to the Ruby interop scripts, plus ways to run them.

    push.rb and worker.rb live in tests/interop/. Every call takes the Redis
    URL explicitly; the scripts read it from REDIS_URL, as Sidekiq does.
    """

    def __init__(self):
        self.ruby = shutil.which("ruby")
        self.interop_dir = INTEROP_DIR
        self.push_rb = INTEROP_DIR / "push.rb"
        self.worker_rb = INTEROP_DIR / "worker.rb"
        self.sidekiq_bin = find_sidekiq_executable(self.ruby)

    def _env(self, url):
        env = dict(os.environ)
        env["REDIS_URL"] = url
        env.pop("REDIS_PROVIDER", None)
        return env

    def _run_push(self, url, argv, timeout=60):
        out = subprocess.run(
            [self.ruby, str(self.push_rb), *argv],
            env=self._env(url), capture_output=True, text=True, timeout=timeout,
        )
        if out.returncode != 0:
            raise AssertionError(f"push.rb {argv} failed ({out.returncode}):\n{out.stderr}")
        return out.stdout.split()

    def push(self, url, cls, args, queue="default", at=None, retry=None):
        """Sidekiq::Client.push from Ruby; returns the jid."""
        argv = [cls, queue, json.dumps(args)]
        if at is not None:
            argv += ["--at", repr(float(at))]
        if retry is not None:
            argv += ["--retry", str(int(retry))]
        (jid,) = self._run_push(url, argv)
        return jid

    def push_bulk(self, url, cls, n, queue="default"):
        """Sidekiq::Client.push_bulk of n jobs with args [0] .. [n-1]; returns the jids."""
        return self._run_push(url, [cls, queue, "[]", "--bulk", str(n)])

    def server(self, url, queues=("default", "other"), concurrency=2, log_path=None, timeout=5):
        """A SidekiqServer (not yet started) running worker.rb's job classes; `timeout` is
        its -t, the seconds running jobs get at stop."""
        return SidekiqServer(self, url, queues, concurrency, log_path, timeout)


class _LoggedProcess:
    """A subprocess that logs to `log_path`: stop with SIGTERM (escalating), tail its log.
    Subclasses set `label` and `stop_timeout`, and provide `start()` and `proc`."""

    label = "process"
    stop_timeout = 30.0

    def stop(self, timeout=None):
        """SIGTERM and wait; returns the exit status (0 on a clean stop)."""
        timeout = self.stop_timeout if timeout is None else timeout
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        os.kill(self.proc.pid, signal.SIGTERM)
        code = _wait_exit(self.proc, timeout)
        if code is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"{self.label} ignored SIGTERM for {timeout:g}s:\n{self.log_tail()}")
        return code

    def log_tail(self, lines=40):
        return _tail(self.log_path, lines)

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        _stop_and_tidy(self, exc_type)


class SidekiqServer(_LoggedProcess):
    """A real `sidekiq` 6.4.1 server process.

    Stopping it: SIGTERM (or SIGINT) makes Sidekiq stop fetching, give running
    jobs up to `-t` seconds (5 unless told), push unfinished ones back onto their
    queues, and exit 0. SIGTSTP only quiets it (stops fetching, keeps running).
    """

    label = "sidekiq"
    stop_timeout = 20.0

    def __init__(self, sidekiq, url, queues, concurrency, log_path=None, timeout=5):
        self.sidekiq = sidekiq
        self.url = url
        self.queues = list(queues)
        self.concurrency = concurrency
        self.timeout = timeout
        self.log_path, self._own_log = _log_file(log_path, "sidekiq-")
        self.proc = None

    def command(self):
        cmd = [
            self.sidekiq.ruby, str(self.sidekiq.sidekiq_bin),
            # -r takes a file to `require`: give an absolute path, since a
            # relative one is searched on $LOAD_PATH, not the cwd.
            "-r", str(self.sidekiq.worker_rb),
            "-c", str(self.concurrency),
            "-t", str(self.timeout),
        ]
        for queue in self.queues:
            cmd += ["-q", queue]
        return cmd

    def start(self, ready_timeout=30.0):
        """Start sidekiq and wait until its heartbeat shows in Redis `processes`."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.sidekiq._env(self.url),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=REPO_ROOT, start_new_session=True, preexec_fn=_die_with_parent,
            )
        client = redis.Redis.from_url(self.url)
        try:
            def ready():
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"sidekiq exited with {self.proc.returncode} at start:\n{self.log_tail()}"
                    )
                return any(f":{self.proc.pid}:".encode() in m for m in client.smembers("processes"))
            wait_until(ready, timeout=ready_timeout, interval=0.05,
                       message=f"sidekiq heartbeat in `processes`; log:\n{self.log_tail()}")
        finally:
            client.close()
        return self



# ---------------------------------------------------------------------------
# forkq worker subprocess
# ---------------------------------------------------------------------------


class ForkqWorker(_LoggedProcess):
    """`python -m forkq start --no-fork ...` as a subprocess; SIGTERM stops it."""

    label = "forkq worker"
    stop_timeout = 30.0

    def __init__(self, url, require, queues=("default",), concurrency=2, extra_args=(),
                 log_path=None, constants=None):
        self.url = url
        self.require = str(require)
        self.queues = list(queues)
        self.concurrency = concurrency
        self.extra_args = list(extra_args)
        self.constants = constants  # forkq module constants to run with (forkq_command)
        self.log_path, self._own_log = _log_file(log_path, "forkq-")
        self.proc = None

    def command(self):
        args = ["start", "--no-fork", "--require", self.require, "--concurrency", str(self.concurrency)]
        for queue in self.queues:
            args += ["--queue", queue]
        return forkq_command(*args, *self.extra_args, constants=self.constants)

    def start(self):
        env = dict(os.environ)
        env["FORKQ_REDIS_URL"] = self.url
        # The repo root first, so `forkq` and `tests.apps...` import from this checkout.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p
        )
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), env=env, cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        return self

    def assert_alive(self):
        if self.proc.poll() is not None:
            raise AssertionError(
                f"forkq worker exited with {self.proc.returncode}:\n{self.log_tail()}"
            )




def wait_beats(r, identity: str, count: int = 3, timeout: float = 10.0) -> None:
    """Wait until the process `identity` has written `count` more heartbeats: what a test
    that checks that something did NOT happen at a beat waits for, instead of a sleep."""
    seen = [r.hget(identity, "beat")]

    def enough():
        beat = r.hget(identity, "beat")
        if beat != seen[-1]:
            seen.append(beat)
        return len(seen) > count
    wait_until(enough, timeout=timeout, interval=0.005, message=f"{count} heartbeats of {identity}")


def record_faults(monkeypatch) -> list:
    """The exceptions that reach Processor._fault (forkq's own code, outside any job) from
    now on, still handled as before: a race test asserts there are none."""
    from forkq import processor
    faults: list[BaseException] = []
    real_fault = processor.Processor._fault

    def fault(self, unit, exc):
        faults.append(exc)
        return real_fault(self, unit, exc)
    monkeypatch.setattr(processor.Processor, "_fault", fault)
    return faults


def switch_threads_often(request, interval: float = 0.00002) -> None:
    """Threads take turns every `interval` s (not 5 ms) until the test ends, so that an
    exception raised from another thread lands all over the code it races."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    request.addfinalizer(lambda: sys.setswitchinterval(old))

class InProcessWorkers:
    """Managers and their Launchers started in the test's own process (no fork), each
    beating every `beat_s` seconds: `start(concurrency)` -> (manager, launcher). For tests
    that reach into a worker (its processors, the watchdog) while it runs for real against
    Redis. `close()` stops them all, then the event loop of async jobs and the default
    client; a test's blocked jobs must be let go first."""

    def __init__(self, redis_url: str, identity: str, queue: str, beat_s: float,
                 info: dict | None = None) -> None:
        self.redis_url, self.identity, self.queue, self.beat_s = redis_url, identity, queue, beat_s
        self.info = {"queues": [queue], **(info or {})}
        self.made: list = []

    def start(self, concurrency: int = 1):
        from forkq.launcher import Launcher
        from forkq.manager import Manager
        from forkq.queues import QueueOrder
        url = self.redis_url
        manager = Manager(lambda: redis.Redis.from_url(url), self.identity,
                          QueueOrder([(self.queue, 0)]), concurrency=concurrency, block_timeout=0.5)
        launcher = Launcher(manager.redis, self.identity, manager, dict(self.info),
                            on_signal=lambda signum: None, interval=self.beat_s)
        manager.start()
        launcher.start()
        self.made.append((manager, launcher))
        return manager, launcher

    def close(self) -> None:
        import forkq
        from forkq import aio
        for manager, launcher in self.made:
            launcher.stop()
            manager.stop(time.monotonic() + 5)
            manager.fetch.close()
        # a thread hung in the event loop's start-up would hold aio's lock: the shutdown
        # would wait for it for good
        if aio._lock.acquire(timeout=2):
            aio._lock.release()
            aio.shutdown()
        forkq.client._default = None
