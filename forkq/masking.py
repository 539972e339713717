"""Passwords out of Redis URLs and of text that holds them, for logs and error messages.

Kept apart from client.py, which imports redis-py: a refused flag or value is reported
(its URL masked) without loading it."""

from __future__ import annotations

import re


def mask_url(url: str) -> str:
    """The URL with any password replaced (in the userinfo or a password= query
    parameter, both of which redis-py accepts, or a sentinel_password= or ssl_password=
    one), fit for logs and status output.

    Done on the text rather than by parsing, so a malformed URL (the kind an error
    message is about to show) is masked too and nothing else in it changes."""
    # the password runs to the LAST "@" before the path: a raw "@" in it must not leak a tail
    return _mask_query(re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:@/?#]*:)[^/?#]*@", r"\1***@", url))


def mask_text(text: str) -> str:
    """`text` (an error message, an echoed command line) with the password of every URL
    in it replaced, as mask_url does for a URL alone."""
    text = re.sub(r"([A-Za-z][A-Za-z0-9+.-]*://[^:@/?#\s]*:)[^/?#\s]*@", r"\1***@", text)
    return re.sub(r"((?:[?&])(?:sentinel_|ssl_)?password=)[^&#\s]*", r"\1***", text)


def _mask_query(text: str) -> str:
    # ssl_password unlocks the client certificate's private key
    return re.sub(r"((?:^|[?&])(?:sentinel_|ssl_)?password=)[^&#]*", r"\1***", text)
