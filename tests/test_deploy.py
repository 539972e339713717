"""The shipped deployment files agree with forkq and with each other.

Part 1: systemd/forkq.service (parsed by hand, and `systemd-analyze verify` when present).
Part 2: deploy/kubernetes/*.yaml (PyYAML).

Commands in both are parsed with forkq's own CLI parser, so a misspelled or removed flag
fails here rather than on a production host; the numbers that must fit together (stop
timeouts against --timeout, memory limits against --max-memory) are checked as relations,
not as copies of the current values.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from forkq import config
from forkq.cli import build_parser
from forkq.settings import STOP_GRACE_S

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "forkq.service"
KUBE = ROOT / "deploy" / "kubernetes"


def parse_cli(argv: list[str], capsys) -> object:
    """forkq's parser on argv (without the program name); a parse error fails the test."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"forkq {' '.join(argv)}: {capsys.readouterr().err.strip()}", pytrace=False)
    if args.command == "start":
        # unset flags are None until resolved; resolve with no environment and no file, so
        # what the test reads is what this command line alone would run with
        settings, _ = config.resolve({o.field: getattr(args, o.dest) for o in config.OPTIONS},
                                     environ={}, config_path=os.devnull)
        for o in config.OPTIONS:
            setattr(args, o.dest, getattr(settings, o.field))
    return args


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


# =====================================================================================
# Part 2: Kubernetes
# =====================================================================================


@pytest.fixture(scope="module")
def yaml():
    return pytest.importorskip("yaml", reason="PyYAML is needed to read the Kubernetes manifests")


@pytest.fixture(scope="module")
def documents(yaml) -> dict[str, list[dict]]:
    found = {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
             for p in sorted(KUBE.glob("*.yaml"))}
    assert "deployment.yaml" in found and "secret.example.yaml" in found, sorted(found)
    return found


@pytest.fixture(scope="module")
def deployment(documents) -> dict:
    deployments = [d for d in documents["deployment.yaml"] if d.get("kind") == "Deployment"]
    assert len(deployments) == 1
    return deployments[0]


@pytest.fixture(scope="module")
def pod(deployment) -> dict:
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    found = [c for c in pod["containers"] if c["name"] == "forkq"]
    assert len(found) == 1
    return found[0]


def start_args(container: dict, capsys):
    command = container["command"] + container.get("args", [])
    assert command[0] == "forkq", command
    assert all(isinstance(a, str) for a in command), f"every argument must be a string: {command}"
    args = parse_cli(command[1:], capsys)
    assert args.command == "start"
    return args


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def quantity_bytes(text: str | int) -> float:
    """A Kubernetes memory quantity ("1Gi", "1024Mi", "1G", "500000000") in bytes."""
    factors = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
               "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T|)", str(text))
    assert match, f"bad memory quantity {text!r}"
    return float(match[1]) * factors[match[2]]


def quantity_cpus(text: str | int | float) -> float:
    """A Kubernetes cpu quantity ("2", "1500m", 0.5) in CPUs."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", str(text))
    assert match, f"bad cpu quantity {text!r}"
    return float(match[1]) / (1000 if match[2] else 1)


MIB = 2**20
MASTER_OVERHEAD_MIB = 200  # the master, probes' `forkq ctl` processes, a draining child


@pytest.mark.timeout(10)
def test_quantity_parsers():
    assert quantity_bytes("1Gi") == 1024 * MIB
    assert quantity_bytes("1000Mi") == 1000 * MIB
    assert quantity_bytes("1G") == 1e9
    assert quantity_bytes(1048576) == MIB
    assert quantity_cpus("1500m") == 1.5
    assert quantity_cpus(2) == 2
    for bad in ("1GB", "lots", "-1Gi"):
        with pytest.raises(AssertionError):
            quantity_bytes(bad)


@pytest.mark.timeout(10)
def test_every_manifest_is_a_kubernetes_object(documents):
    for name, docs in documents.items():
        assert docs, f"{name} is empty"
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), name


@pytest.mark.timeout(10)
def test_container_command_parses_with_forkq_cli(container, capsys):
    args = start_args(container, capsys)
    assert not args.no_fork
    assert args.require
    assert args.processes is not None, "set --processes: the CPU count a pod sees is the node's"
    assert args.max_memory is not None, "set --max-memory: the memory limit is computed from it"
    assert args.log_format == "json"


@pytest.mark.timeout(10)
def test_grace_period_exceeds_forkq_stop(pod, container, capsys):
    args = start_args(container, capsys)
    grace = pod["terminationGracePeriodSeconds"]
    # the grace period also covers the preStop hook, hence strictly more than the stop
    assert grace > args.timeout + STOP_GRACE_S, (grace, args.timeout, STOP_GRACE_S)


@pytest.mark.timeout(10)
def test_prestop_quiets_the_master(container, capsys):
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["forkq", "ctl", "quiet"], command
    args = parse_cli(command[1:], capsys)
    assert (args.command, args.action) == ("ctl", "quiet")
    assert not (args.identity or args.host or args.all), "preStop must quiet this pod's master only"


@pytest.mark.timeout(10)
def test_probes_run_forkq_ctl_check(container, capsys):
    start = start_args(container, capsys)
    probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}
    assert "readinessProbe" in probes and "livenessProbe" in probes
    for name, probe in probes.items():
        command = probe["exec"]["command"]
        assert command[:3] == ["forkq", "ctl", "check"], (name, command)
        args = parse_cli(command[1:], capsys)
        assert (args.command, args.action) == ("ctl", "check")
        # a child heartbeats every --heartbeat-interval; check must tolerate a late beat
        assert args.max_age >= 2 * start.heartbeat_interval, (name, args.max_age)
        # `forkq ctl` is a fresh Python process that talks to Redis: give it time
        assert probe.get("timeoutSeconds", 1) >= 5, name


@pytest.mark.timeout(10)
def test_memory_limit_covers_every_child_and_the_master(container, capsys):
    args = start_args(container, capsys)
    resources = container["resources"]
    limit = quantity_bytes(resources["limits"]["memory"])
    needed = (args.processes * args.max_memory + MASTER_OVERHEAD_MIB) * MIB
    assert limit >= needed, f"limit {limit / MIB:g} MiB < {args.processes} x {args.max_memory:g} MiB + " \
                            f"{MASTER_OVERHEAD_MIB} MiB"
    assert quantity_bytes(resources["requests"]["memory"]) <= limit


@pytest.mark.timeout(10)
def test_cpu_matches_processes(container, capsys):
    args = start_args(container, capsys)
    resources = container["resources"]
    assert quantity_cpus(resources["requests"]["cpu"]) == args.processes
    assert quantity_cpus(resources["limits"]["cpu"]) == args.processes


@pytest.mark.timeout(10)
def test_redis_url_comes_from_the_example_secret(container, documents):
    env = env_of(container)
    url = env["FORKQ_REDIS_URL"]
    assert "value" not in url, "a Redis URL with a password does not belong in the manifest"
    ref = url["valueFrom"]["secretKeyRef"]
    secrets = {d["metadata"]["name"]: d for d in documents["secret.example.yaml"] if d["kind"] == "Secret"}
    assert ref["name"] in secrets, (ref, sorted(secrets))
    secret = secrets[ref["name"]]
    assert ref["key"] in secret.get("stringData", {}) or ref["key"] in secret.get("data", {}), ref


@pytest.mark.timeout(10)
def test_example_secret_holds_a_url_forkq_accepts(documents):
    from forkq import client
    for doc in documents["secret.example.yaml"]:
        for value in doc.get("stringData", {}).values():
            conn = client.connect(value)  # validates; does not connect
            conn.close()


@pytest.mark.timeout(10)
def test_start_and_ctl_agree_on_a_writable_pidfile(container, capsys, monkeypatch):
    # `forkq ctl quiet` and `forkq ctl check` find the master through the pidfile that
    # `forkq start` wrote: same path for both, in a directory the container can write
    from forkq import control
    path = env_of(container)["FORKQ_PIDFILE"]["value"]
    monkeypatch.setenv("FORKQ_PIDFILE", path)
    assert control.default_pidfile() == path
    commands = [container["command"], container["lifecycle"]["preStop"]["exec"]["command"]]
    commands += [container[k]["exec"]["command"] for k in ("startupProbe", "readinessProbe", "livenessProbe")
                 if k in container]
    for command in commands:
        assert parse_cli(command[1:], capsys).pidfile in (None, path), command
    if container.get("securityContext", {}).get("readOnlyRootFilesystem"):
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        assert str(Path(path).parent) in mounts, f"{path} is on the read-only root filesystem"


@pytest.mark.timeout(10)
def test_rollout_keeps_capacity(deployment):
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1
