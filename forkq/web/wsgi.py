"""Just enough WSGI plumbing for the dashboard: a parsed request and a response. Form
bodies are small url-encoded forms we rendered ourselves, so a size cap and
urllib.parse cover them; nothing here needs a framework."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote

MAX_FORM_BYTES = 1 << 20  # a bulk form with 10,000 checked rows is well under this


class BadRequest(Exception):
    pass


class Request:
    def __init__(self, environ: dict[str, Any]) -> None:
        self.environ = environ
        self.method = environ.get("REQUEST_METHOD", "GET").upper()
        # WSGI hands PATH_INFO over as latin-1 decoded bytes; undo that to get UTF-8 back
        raw_path = environ.get("PATH_INFO", "") or "/"
        try:
            self.path = raw_path.encode("latin-1").decode("utf-8")
        except UnicodeError:
            self.path = raw_path
        # where the app is mounted ("" at the root): every link and redirect starts here
        self.root = environ.get("SCRIPT_NAME", "").rstrip("/")
        self.query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        self._form: dict[str, list[str]] | None = None
        self.csrf: str | None = None  # this request's CSRF token, once a page needed one
        self.set_cookies: list[tuple[str, str]] = []  # Set-Cookie headers for the answer

    def arg(self, name: str, default: str = "") -> str:
        values = self.query.get(name)
        return values[0] if values else default

    def int_arg(self, name: str, default: int = 1) -> int:
        try:
            return max(1, int(self.arg(name, str(default))))
        except ValueError:
            return default

    @property
    def form(self) -> dict[str, list[str]]:
        if self._form is None:
            self._form = self._read_form()
        return self._form

    def field(self, name: str, default: str = "") -> str:
        values = self.form.get(name)
        return values[0] if values else default

    def _read_form(self) -> dict[str, list[str]]:
        if self.method != "POST":
            return {}
        try:
            length = int(self.environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            raise BadRequest("bad Content-Length") from None
        if length > MAX_FORM_BYTES:
            raise BadRequest("form too large")
        kind = self.environ.get("CONTENT_TYPE", "").split(";")[0].strip().lower()
        body = self.environ["wsgi.input"].read(length) if length > 0 else b""
        if kind not in ("application/x-www-form-urlencoded", ""):
            raise BadRequest(f"expected a url-encoded form, not {kind}")
        try:
            return parse_qs(body.decode("utf-8"), keep_blank_values=True)
        except UnicodeDecodeError:
            raise BadRequest("form is not UTF-8") from None

    def url(self, path: str) -> str:
        """An absolute path inside the app, honouring the mount point."""
        return self.root + quote(path, safe="/?=&%:;~.-_")


@dataclass
class Response:
    body: bytes = b""
    status: str = "200 OK"
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)
    cache: str = "no-store"

    @classmethod
    def html(cls, text: str, status: str = "200 OK") -> "Response":
        # a lone surrogate (JSON lets "\ud800" in) has no UTF-8: show it as the text \ud800
        return cls(text.encode("utf-8", "backslashreplace"), status)

    @classmethod
    def json(cls, data: Any) -> "Response":
        return cls(json.dumps(data).encode(), content_type="application/json")

    @classmethod
    def text(cls, text: str, status: str) -> "Response":
        return cls(text.encode("utf-8"), status, "text/plain; charset=utf-8")

    @classmethod
    def redirect(cls, location: str) -> "Response":
        # 303: the browser follows with a GET, so reloading the result page re-posts nothing
        return cls(b"", "303 See Other", headers=[("Location", location)])
