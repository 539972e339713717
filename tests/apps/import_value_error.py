"""An app whose import fails with a ValueError of its own, as an int() of an unset setting
would: `forkq start` must show where it came from, not pass it off as a forkq setting."""

RETRIES = int("")  # noqa: F841
