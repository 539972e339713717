"""forkq's types as a user's type checker sees them (tests/typing_app.py). Runs only where
mypy is installed: CI installs none, so there this is skipped."""

import re
import tomllib
from pathlib import Path

import pytest

import forkq

APP = Path(__file__).with_name("typing_app.py")
ROOT = Path(forkq.__file__).parent.parent


def test_py_typed_is_shipped() -> None:
    # PEP 561: without the marker (in the wheel too) a user's mypy ignores forkq's annotations
    assert (ROOT / "forkq" / "py.typed").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["forkq"]


def _expected() -> tuple[set[tuple[int, str]], set[tuple[int, str]]]:
    errors, reveals = set(), set()
    for n, line in enumerate(APP.read_text().splitlines(), 1):
        if m := re.search(r"# E: ([\w-]+)$", line):
            errors.add((n, m.group(1)))
        if m := re.search(r"# R: (.+)$", line):
            reveals.add((n, m.group(1)))
    return errors, reveals


def test_user_app_type_checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                              tmp_path: Path) -> None:
    api = pytest.importorskip("mypy.api")
    # forkq from this tree, however it was installed (an editable install's import hook is
    # one mypy cannot follow); its own modules' findings are not the user's: silent
    monkeypatch.setenv("MYPYPATH", str(ROOT))
    # pytest's cache keeps mypy's warm between runs; without it (-p no:cacheprovider) a
    # temporary one, not a .mypy_cache left in the tree
    kept = getattr(request.config, "cache", None)
    cache = kept.mkdir("mypy") if kept is not None else tmp_path / "mypy_cache"
    out, err, _status = api.run([str(APP), "--strict", "--follow-imports=silent", "--show-error-codes",
                                 "--no-error-summary", "--no-pretty", "--cache-dir", str(cache)])
    assert not err, err
    errors, reveals = set(), set()
    for line in out.splitlines():
        m = re.match(r"(.+?):(\d+): (error|note): (.*?)(?:  \[([\w-]+)\])?$", line)
        assert m, line
        assert Path(m.group(1)).name == APP.name, line
        n = int(m.group(2))
        if m.group(3) == "error":
            errors.add((n, m.group(5)))
        elif r := re.fullmatch(r'Revealed type is "(.*)"', m.group(4)):
            reveals.add((n, r.group(1)))
    want_errors, want_reveals = _expected()
    assert reveals == want_reveals, out
    # every good call passes, every bad one is reported, with the code expected
    assert errors == want_errors, out
