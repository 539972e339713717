"""The shipped deployment files agree with forkq and with each other.

Part 1: systemd/forkq.service (parsed by hand, and `systemd-analyze verify` when present).

Commands in both are parsed with forkq's own CLI parser, so a misspelled or removed flag
fails here rather than on a production host; the numbers that must fit together (stop
timeouts against --timeout) are checked as relations, not as copies of the current values.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from forkq.cli import build_parser
from forkq.supervisor import STOP_GRACE_S

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "forkq.service"
KUBE = ROOT / "deploy" / "kubernetes"


def parse_cli(argv: list[str], capsys) -> object:
    """forkq's parser on argv (without the program name); a parse error fails the test."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"forkq {' '.join(argv)}: {capsys.readouterr().err.strip()}", pytrace=False)


# =====================================================================================
# Part 1: the systemd unit
# =====================================================================================

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Sections -> key -> every value given (systemd allows repeated keys), in order."""
    sections: Unit = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):  # continuation: the backslash becomes a space
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"line {number} is not KEY=VALUE in a section: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def timespan_s(text: str) -> float:
    """A systemd time span ("40", "40s", "1min 30s", "500ms") in seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "": 1, "s": 1, "sec": 1, "m": 60, "min": 60,
             "h": 3600, "hr": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text.strip())
    assert parts and "".join(n + u for n, u in parts) == text.replace(" ", ""), f"bad time span {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.fixture(scope="module")
def unit() -> Unit:
    return parse_unit(UNIT.read_text())


def one(unit: Unit, section: str, key: str) -> str:
    values = unit.get(section, {}).get(key, [])
    assert len(values) == 1, f"[{section}] {key}= should be set once, found {values}"
    return values[0]


def exec_start(unit: Unit) -> list[str]:
    return shlex.split(one(unit, "Service", "ExecStart"))


@pytest.mark.timeout(10)
def test_timespan_parser():
    assert timespan_s("40") == 40
    assert timespan_s("40s") == 40
    assert timespan_s("1min 30s") == 90
    assert timespan_s("500ms") == 0.5
    with pytest.raises(AssertionError):
        timespan_s("forty")


@pytest.mark.timeout(10)
def test_unit_parser_keeps_repeated_keys_and_rejects_junk():
    parsed = parse_unit("# c\n[Service]\nEnvironment=A=1\nEnvironment=B=2\n; c\nExecStart=/x \\\n  --y\n")
    assert parsed == {"Service": {"Environment": ["A=1", "B=2"], "ExecStart": ["/x  --y"]}}
    with pytest.raises(AssertionError):
        parse_unit("[Service]\nnot an assignment\n")


@pytest.mark.timeout(10)
def test_unit_is_type_notify_and_only_the_master_notifies(unit):
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    # a watchdog that the master pings at half the period, from a loop that wakes every
    # 0.5 s: anything under a couple of seconds would be fragile
    assert timespan_s(one(unit, "Service", "WatchdogSec")) >= 2


@pytest.mark.timeout(10)
def test_unit_exec_start_parses_with_forkq_cli(unit, capsys):
    argv = exec_start(unit)
    assert os.path.basename(argv[0]) == "forkq", argv
    args = parse_cli(argv[1:], capsys)
    assert args.command == "start"
    assert not args.no_fork, "under systemd the master must run (Type=notify is its job)"
    assert args.require, "ExecStart should --require the app's jobs"


@pytest.mark.timeout(10)
def test_unit_pidfile_is_in_its_runtime_directory(unit, capsys):
    args = parse_cli(exec_start(unit)[1:], capsys)
    runtime = one(unit, "Service", "RuntimeDirectory")
    assert args.pidfile is not None, "ExecStart should pass --pidfile so `forkq ctl` can find it"
    # RuntimeDirectory=forkq is /run/forkq, created for User= and removed at stop
    assert Path(args.pidfile).parent == Path("/run") / runtime


@pytest.mark.timeout(10)
def test_unit_kills_the_master_only_then_everything(unit):
    assert one(unit, "Service", "KillMode") == "mixed"
    assert one(unit, "Service", "KillSignal") in ("SIGTERM", "TERM", "15")


@pytest.mark.timeout(10)
def test_unit_stop_timeout_exceeds_forkq_stop(unit, capsys):
    args = parse_cli(exec_start(unit)[1:], capsys)
    stop = timespan_s(one(unit, "Service", "TimeoutStopSec"))
    # forkq needs --timeout for running jobs plus STOP_GRACE_S before it kills children
    # and puts their jobs back; systemd's SIGKILL must come after all that
    assert stop > args.timeout + STOP_GRACE_S, (stop, args.timeout, STOP_GRACE_S)


@pytest.mark.timeout(10)
def test_unit_reload_sends_hup_to_the_main_pid(unit):
    argv = shlex.split(one(unit, "Service", "ExecReload"))
    assert os.path.basename(argv[0]) == "kill", argv
    sends_hup = any(a in ("-HUP", "-SIGHUP", "-1") for a in argv[1:]) or any(
        a == "-s" and b in ("HUP", "SIGHUP", "1") for a, b in zip(argv[1:], argv[2:]))
    assert sends_hup, argv
    assert argv[-1] == "$MAINPID", argv


@pytest.mark.timeout(10)
def test_unit_restarts_on_failure_but_not_on_bad_config(unit):
    assert one(unit, "Service", "Restart") == "on-failure"
    assert timespan_s(one(unit, "Service", "RestartSec")) > 0
    # forkq exits 2 for bad flags or a bad --require: restarting cannot fix that
    assert "2" in one(unit, "Service", "RestartPreventExitStatus").split()


@pytest.mark.timeout(10)
def test_unit_survives_a_child_oom_kill(unit):
    # systemd's default (OOMPolicy=stop) would stop the whole service for one child
    assert one(unit, "Service", "OOMPolicy") == "continue"


@pytest.mark.timeout(10)
def test_unit_user_redis_url_and_install(unit):
    assert one(unit, "Service", "User")
    env = unit["Service"].get("Environment", []) + unit["Service"].get("EnvironmentFile", [])
    assert any(e.startswith("FORKQ_REDIS_URL=") for e in env), env
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


@pytest.mark.timeout(60)
def test_unit_passes_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (package systemd)")
    # verify rejects an ExecStart binary that does not exist, and /usr/local/bin/forkq
    # does not exist on a test machine: check a copy whose ExecStart runs /bin/true with
    # the same arguments. (User=forkq is not looked up by verify, so it stays.)
    true = shutil.which("true") or "/bin/true"
    text = UNIT.read_text()
    copied, count = re.subn(r"(?m)^ExecStart=\S+", f"ExecStart={true}", text)
    assert count == 1
    target = tmp_path / "forkq.service"
    target.write_text(copied)
    result = subprocess.run([tool, "verify", "--man=no", str(target)], capture_output=True,
                            text=True, timeout=50, cwd=tmp_path)
    output = (result.stdout + result.stderr).strip()
    # verify exits 0 on an unknown key or an unparsable value and only prints a warning
    # naming the file; lines about other units or the environment are not ours
    ours = [line for line in output.splitlines() if "forkq.service" in line]
    assert result.returncode == 0 and not ours, output
