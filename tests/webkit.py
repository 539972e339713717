"""Test helpers for the dashboard: `forkq web` as a real subprocess, and a tiny HTTP client
that keeps cookies and reads the CSRF token off a page, as a browser would.

    with WebServer(redis_url) as web:
        page = Client(web.base).get("/dead")
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import subprocess
import sys
import zlib
from http.cookies import SimpleCookie
from urllib.parse import urlencode, urlsplit

from helpers import REPO_ROOT, _LoggedProcess, _die_with_parent, _log_file, free_port, wait_until


def forkq_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    for name in ("FORKQ_WEB_PASSWORD", "FORKQ_WEB_TOKEN"):
        env.pop(name, None)
    env.update(extra or {})
    return env


class WebServer(_LoggedProcess):
    """`python -m forkq web --port P --redis-url URL ARGS...`; start() returns once it answers."""

    label = "forkq web"
    stop_timeout = 10.0

    def __init__(self, redis_url: str, *args: str, env: dict[str, str] | None = None,
                 prefix: str = "", command: list[str] | None = None) -> None:
        self.port = free_port()
        self.prefix = prefix
        self.cmd = command or [sys.executable, "-m", "forkq", "web", "--port", str(self.port),
                               "--redis-url", redis_url, *args]
        self.env = forkq_env(env)
        self.log_path, self._own_log = _log_file(None, "forkq-web-")
        self.proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.prefix}"

    def start(self) -> "WebServer":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)

        def answers() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"forkq web exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", self.prefix + "/static/dashboard.css")
                return conn.getresponse().status == 200
            except OSError:
                return False
        wait_until(answers, timeout=20, interval=0.05, message=f"forkq web answering\n{self.log_tail()}")
        return self


class Page:
    def __init__(self, status: int, headers: http.client.HTTPMessage, body: str) -> None:
        self.status = status
        self.headers = headers
        self.text = body

    @property
    def csrf(self) -> str:
        found = re.search(r'name="csrf" value="([^"]+)"', self.text)
        assert found, f"no CSRF field on the page:\n{self.text[:2000]}"
        return found.group(1)

    def json(self):
        return json.loads(self.text)

    def __repr__(self) -> str:
        return f"<Page {self.status} {self.text[:300]!r}>"


class Client:
    """One browser-like session: cookies kept, redirects not followed (tests look at them)."""

    def __init__(self, base: str, auth: tuple[str, str] | None = None, bearer: str | None = None) -> None:
        parts = urlsplit(base)
        self.host, self.port, self.prefix = parts.hostname, parts.port, parts.path.rstrip("/")
        self.cookies: dict[str, str] = {}
        self.auth = auth
        self.bearer = bearer

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> Page:
        all_headers = {"Host": f"{self.host}:{self.port}"}
        if self.cookies:
            all_headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        if self.auth:
            all_headers["Authorization"] = "Basic " + base64.b64encode(":".join(self.auth).encode()).decode()
        if self.bearer:
            all_headers["Authorization"] = f"Bearer {self.bearer}"
        if body is not None:
            all_headers["Content-Type"] = "application/x-www-form-urlencoded"
        all_headers.update(headers or {})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=15)
        try:
            conn.request(method, self.prefix + path, body=body, headers=all_headers)
            resp = conn.getresponse()
            text = resp.read().decode("utf-8")
        finally:
            conn.close()
        for header in resp.headers.get_all("Set-Cookie") or []:
            jar = SimpleCookie()
            jar.load(header)
            for name, morsel in jar.items():
                if morsel["max-age"] == "0":
                    self.cookies.pop(name, None)
                else:
                    self.cookies[name] = morsel.value
        return Page(resp.status, resp.headers, text)

    def get(self, path: str, **kwargs) -> Page:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, fields: list[tuple[str, str]] | dict[str, str], csrf: str | None = None,
             **kwargs) -> Page:
        """POST a form; csrf=None sends the token a page would carry (the hidden field holds
        the same value as the CSRF cookie a GET set), csrf="" sends none."""
        items = list(fields.items()) if isinstance(fields, dict) else list(fields)
        if csrf is None:
            if "forkq_csrf" not in self.cookies:
                self.get("/")
            csrf = self.cookies["forkq_csrf"]
        if csrf:
            items.append(("csrf", csrf))
        return self.request("POST", path, body=urlencode(items).encode(), **kwargs)


def ruby_backtrace(lines: list[str]) -> str:
    """An `error_backtrace` as Sidekiq 6+ writes it: Base64.encode64 (a line break every 60
    characters) of Zlib::Deflate.deflate of the JSON array."""
    blob = base64.b64encode(zlib.compress(json.dumps(lines).encode())).decode()
    return "".join(blob[i:i + 60] + "\n" for i in range(0, len(blob), 60))


def run_forkq(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forkq", *args], cwd=REPO_ROOT, env=forkq_env(env),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
