"""Configuration for `forkq start`: flag > FORKQ_* environment > file > default.

The file is `[tool.forkq]` in ./pyproject.toml, or whatever `--config PATH` (or
FORKQ_CONFIG) names: a forkq.toml with top-level keys, or a pyproject.toml. The fast
precedence table goes through `forkq.config.resolve` directly; the rest runs
`python -m forkq start --print-config` in a subprocess whose cwd is the test's tmp_path
(so a pyproject.toml written there is the one read) and parses what it prints; the long
tables of bad values call `forkq.cli.main` in-process the same way (same argv, cwd and
environment, stdout/stderr captured), with a subprocess run per source beside them. Bad
values from any source must give exit 2, one line on stderr naming the setting, the
source and what it accepts, and no traceback. A Redis password must never be printed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from forkq import cli, config
from forkq.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-Pw0rd"
URL = f"redis://forkquser:{SECRET}@127.0.0.1:6399/0"


# -- helpers ---------------------------------------------------------------------------------


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ without any FORKQ_* variable (the redis fixtures set one), plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKQ_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def run_start(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forkq", "start", "--print-config", *args],
                          cwd=cwd, env=_clean_env(env), capture_output=True, text=True,
                          timeout=20, stdin=subprocess.DEVNULL)


@pytest.fixture
def start_inproc(tmp_path, monkeypatch, capsys):
    """start_inproc(*args, env={}): `forkq start --print-config *args` as cli.main, in tmp_path."""
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith("FORKQ_")]:
        monkeypatch.delenv(name)

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        argv = ["start", "--print-config", *args]
        with monkeypatch.context() as m:
            for name, value in (env or {}).items():
                m.setenv(name, value)
            capsys.readouterr()
            try:
                code = cli.main(argv)
            except SystemExit as exc:  # argparse's errors
                code = exc.code
            out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out, err)
    return run


def parse_config(out: subprocess.CompletedProcess) -> dict[str, tuple[object, str]]:
    """{setting name: (value, source)} from --print-config's `name = value # source` lines."""
    assert out.returncode == 0, (out.returncode, out.stderr, out.stdout)
    assert "Traceback" not in out.stderr
    table = {}
    for line in out.stdout.splitlines():
        name, sep, rest = line.partition(" = ")
        assert sep, f"not a `name = value # source` line: {line!r}"
        value, sep, source = rest.rpartition(" # ")
        assert sep, f"no source on line: {line!r}"
        table[name.strip()] = (ast.literal_eval(value.strip()), source.strip())
    assert set(table) == {o.name for o in config.OPTIONS}, out.stdout
    return table


def one_line_error(out: subprocess.CompletedProcess, *expected: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr, out.stdout)
    err = out.stderr.strip()
    assert err and "\n" not in err, f"not one line on stderr:\n{out.stderr}"
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stdout == "", "printed a config despite the error"
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"
    return err


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- resolve(): the precedence table, in-process ---------------------------------------------

# field: (flag value, env text, file TOML value, default; and what each layer resolves to)
TABLE = {
    "concurrency": dict(flag=7, env="6", file="5", want={"flag": 7, "env": 6, "file": 5, "default": 10}),
    "queues": dict(flag=[("f", 0)], env="e1 e2,3", file='["a,2", "b"]',
                   want={"flag": [("f", 0)], "env": [("e1", 0), ("e2", 3)],
                         "file": [("a", 2), ("b", 0)], "default": [("default", 0)]}),
    "timeout": dict(flag=1.5, env="2.5", file="3",
                    want={"flag": 1.5, "env": 2.5, "file": 3.0, "default": 25.0}),
    "max_memory_mb": dict(flag=100.0, env="200", file="300.5",
                          want={"flag": 100.0, "env": 200.0, "file": 300.5, "default": None}),
    "log_level": dict(flag="debug", env="warning", file='"error"',
                      want={"flag": "debug", "env": "warning", "file": "error", "default": "info"}),
    # a switch: the flag can only turn it on, FORKQ_NO_FORK=0 turns a file's true off
    "no_fork": dict(flag=True, env="0", file="true",
                    want={"flag": True, "env": False, "file": True, "default": False}),
    "reload": dict(flag=True, env="off", file="true",
                   want={"flag": True, "env": False, "file": True, "default": False}),
    "processes": dict(flag=3, env="4", file="5", want={"flag": 3, "env": 4, "file": 5, "default": None}),
    "poison_after": dict(flag=9, env="8", file="7", want={"flag": 9, "env": 8, "file": 7, "default": 3}),
    "tag": dict(flag="f", env="e", file='"file"', want={"flag": "f", "env": "e", "file": "file", "default": ""}),
    "require": dict(flag=["flag.jobs"], env="env.a env.b", file='"file.jobs"',
                    want={"flag": ["flag.jobs"], "env": ["env.a", "env.b"], "file": ["file.jobs"],
                          "default": []}),
}


def _option(field: str) -> config.Option:
    (o,) = [o for o in config.OPTIONS if o.field == field]
    return o


@pytest.mark.timeout(10)
@pytest.mark.parametrize("layer", ["flag", "env", "file", "default"])
@pytest.mark.parametrize("field", sorted(TABLE))
def test_resolve_precedence(tmp_path, monkeypatch, field, layer):
    monkeypatch.chdir(tmp_path)  # no stray ./pyproject.toml
    row, o = TABLE[field], _option(field)
    layers = ["flag", "env", "file", "default"]
    present = layers[layers.index(layer):]  # this layer and every weaker one are set
    flags = {field: row["flag"]} if "flag" in present else {}
    environ = {o.env: row["env"]} if "env" in present else {}
    path = write(tmp_path / "forkq.toml", f"{o.name} = {row['file']}\n" if "file" in present else "")
    settings, sources = config.resolve(flags, environ=environ, config_path=str(path))
    want = row["want"][layer]
    if field == "processes" and layer == "default":
        want = os.cpu_count() or 1
    assert getattr(settings, field) == want
    assert sources[field] == (str(path) if layer == "file" else layer)
    # nothing else moved
    assert all(s == "default" for f, s in sources.items() if f != field), sources


# a valid value per option, as env text and as a TOML value, and what it parses to: a new
# option without an entry here fails test_every_option_comes_from_env_and_file
SAMPLES = {
    "require": ("a.jobs b.jobs", '["a.jobs", "b.jobs"]', ["a.jobs", "b.jobs"]),
    "processes": ("3", "3", 3),
    "concurrency": ("4", "4", 4),
    "queues": ("hi,3 lo", '["hi,3", "lo"]', [("hi", 3), ("lo", 0)]),
    "timeout": ("2.5", "2.5", 2.5),
    "redis_url": ("redis://h:1/2", '"redis://h:1/2"', "redis://h:1/2"),
    "no_fork": ("yes", "true", True),
    "poll_interval": ("0.5", "0.5", 0.5),
    "heartbeat_interval": ("1.5", "1.5", 1.5),
    "tag": ("blue", '"blue"', "blue"),
    "log_level": ("error", '"error"', "error"),
    "log_format": ("text", '"text"', "text"),
    "max_memory_mb": ("512", "512", 512.0),
    "max_jobs": ("1000", "1000", 1000),
    "hang_timeout": ("12", "12", 12.0),
    "time_limit_grace": ("3", "3", 3.0),
    "poison_after": ("5", "5", 5),
    "recovery_delay": ("90", "90", 90.0),
    "pidfile": ("/run/x.pid", '"/run/x.pid"', "/run/x.pid"),
    "reload": ("1", "true", True),
    "metrics_port": ("9100", "9100", 9100),
    "metrics_bind": ("::", '"::"', "::"),
}


@pytest.mark.timeout(10)
def test_every_option_comes_from_env_and_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert set(SAMPLES) == {o.field for o in config.OPTIONS}, "add the new option to SAMPLES"
    for o in config.OPTIONS:
        env_text, toml_value, want = SAMPLES[o.field]
        assert o.env == "FORKQ_" + o.flag[2:].upper().replace("-", "_")
        settings, sources = config.resolve({}, environ={o.env: env_text}, config_path=None)
        assert (getattr(settings, o.field), sources[o.field]) == (want, "env"), o.env
        # the file takes the flag's name, with dashes or underscores
        for key in {o.name, o.name.replace("-", "_")}:
            path = write(tmp_path / "forkq.toml", f"{key} = {toml_value}\n")
            settings, sources = config.resolve({}, environ={}, config_path=str(path))
            assert (getattr(settings, o.field), sources[o.field]) == (want, str(path)), key


@pytest.mark.timeout(10)
@pytest.mark.parametrize("environ, text, expected", [
    ({"FORKQ_CONCURRENCY": "lots"}, "", ["FORKQ_CONCURRENCY", "--concurrency", "whole number"]),
    ({}, 'timeout = "soon"\n', ["forkq.toml", "timeout", "--timeout", "number"]),
    ({}, "concurency = 3\n", ["forkq.toml", "'concurency'"]),
])
def test_resolve_raises_config_error_naming_setting_and_source(tmp_path, monkeypatch, environ, text, expected):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path / "forkq.toml", text)
    with pytest.raises(ConfigError) as exc:
        config.resolve({}, environ=environ, config_path=str(path))
    for fragment in expected:
        assert fragment in str(exc.value)


# -- --print-config end to end ---------------------------------------------------------------


@pytest.mark.timeout(30)
def test_print_config_flag_over_env_over_pyproject_over_default(tmp_path):
    write(tmp_path / "pyproject.toml", """
[project]
name = "someapp"

[tool.forkq]
concurrency = 5
queue = ["file_a,2", "file_b"]
timeout = 3
log-level = "error"
no_fork = false
hang-timeout = 12
redis_url = "%s"
""" % URL)
    out = run_start(tmp_path, "-c", "7", "--log-level", "debug",
                    env={"FORKQ_CONCURRENCY": "6", "FORKQ_QUEUE": "env1 env2,2",
                         "FORKQ_LOG_LEVEL": "warning", "FORKQ_NO_FORK": "1",
                         "FORKQ_MAX_MEMORY": "256"})
    got = parse_config(out)
    assert got["concurrency"] == (7, "flag")                     # flag > env > file
    assert got["log-level"] == ("debug", "flag")
    assert got["queue"] == (["env1", "env2,2"], "env")           # env > file
    assert got["no-fork"] == (True, "env")
    assert got["max-memory"] == (256.0, "env")
    assert got["timeout"] == (3.0, "pyproject.toml")             # file > default
    assert got["hang-timeout"] == (12.0, "pyproject.toml")
    assert got["poison-after"] == (3, "default")                 # default
    assert got["poll-interval"] == (5.0, "default")
    assert got["redis-url"] == ("redis://forkquser:***@127.0.0.1:6399/0", "pyproject.toml")
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.timeout(30)
def test_print_config_names_the_pidfile_start_would_use_when_none_is_set(tmp_path, start_inproc):
    got = parse_config(start_inproc())
    assert got["pidfile"] == (os.path.join(tempfile.gettempdir(), "forkq.pid"), "default")
    got = parse_config(start_inproc(env={"FORKQ_PIDFILE": str(tmp_path / "m.pid")}))
    assert got["pidfile"] == (str(tmp_path / "m.pid"), "env")


@pytest.mark.timeout(30)
def test_print_config_flags_replace_a_repeated_setting_whole(tmp_path, start_inproc):
    write(tmp_path / "pyproject.toml", '[tool.forkq]\nqueue = ["file"]\nrequire = ["file.jobs"]\n')
    got = parse_config(start_inproc("-q", "x,2", "-q", "y,1", env={"FORKQ_QUEUE": "env"}))
    assert got["queue"] == (["x,2", "y,1"], "flag")
    assert got["require"] == (["file.jobs"], "pyproject.toml")


@pytest.mark.timeout(30)
def test_an_empty_flag_value_still_beats_env_and_file(tmp_path, start_inproc):
    write(tmp_path / "pyproject.toml", '[tool.forkq]\ntag = "file"\n')
    got = parse_config(start_inproc("--tag", "", env={"FORKQ_TAG": "env"}))
    assert got["tag"] == ("", "flag")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["flag", "FORKQ_CONFIG"])
def test_config_file_with_top_level_keys_replaces_pyproject(tmp_path, start_inproc, how):
    write(tmp_path / "pyproject.toml", "[tool.forkq]\nconcurrency = 5\ntimeout = 3\n")
    conf = write(tmp_path / "etc" / "forkq.toml", 'concurrency = 4\nqueue = "only"\nmax_memory = 100\n')
    if how == "flag":
        got = parse_config(start_inproc("--config", str(conf)))
    else:  # end to end: the environment variable read by the command itself
        got = parse_config(run_start(tmp_path, env={"FORKQ_CONFIG": str(conf)}))
    assert got["concurrency"] == (4, str(conf))
    assert got["queue"] == (["only"], str(conf))
    assert got["max-memory"] == (100.0, str(conf))
    assert got["timeout"] == (25.0, "default")  # the pyproject.toml is not read as well


@pytest.mark.timeout(30)
def test_config_may_name_a_pyproject_elsewhere(tmp_path, start_inproc):
    other = write(tmp_path / "svc" / "pyproject.toml", "[tool.forkq]\nconcurrency = 3\n")
    got = parse_config(start_inproc("--config", str(other)))
    assert got["concurrency"] == (3, str(other))


@pytest.mark.timeout(30)
def test_pyproject_without_forkq_section_is_fine(tmp_path, start_inproc):
    write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n[tool.black]\nline-length = 99\n')
    got = parse_config(start_inproc())
    assert all(source == "default" for _, source in got.values()), got


# a ./pyproject.toml that tomllib cannot read: TOML 1.1 syntax (newlines in an inline
# table), a plain syntax error, or bytes that are not UTF-8
UNPARSEABLE_PYPROJECT = {
    "toml-1.1": b'[project]\nname = "x"\n[tool.other]\nmap = {\n  a = 1,\n}\n',
    "syntax": b'[project]\nname = = "x"\n',
    "not-utf8": b'[project]\nname = "caf\xe9"\n',
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(UNPARSEABLE_PYPROJECT))
def test_an_unparseable_pyproject_without_forkq_settings_is_not_forkqs_business(tmp_path, start_inproc,
                                                                                 case):
    (tmp_path / "pyproject.toml").write_bytes(UNPARSEABLE_PYPROJECT[case])
    got = parse_config(start_inproc("-c", "3"))
    assert got["concurrency"] == (3, "flag")
    assert all(source == "default" for name, (_, source) in got.items() if name != "concurrency"), got


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(UNPARSEABLE_PYPROJECT))
def test_an_unparseable_pyproject_that_names_tool_forkq_fails_in_one_line(tmp_path, start_inproc, case):
    # its [tool.forkq] could hold the Redis URL or the queues: running without them is wrong
    (tmp_path / "pyproject.toml").write_bytes(UNPARSEABLE_PYPROJECT[case] + b"\n[tool.forkq]\nconcurrency = 3\n")
    one_line_error(start_inproc(), "pyproject.toml", "not valid TOML")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["pyproject", "config"])
def test_unknown_key_fails_in_one_line_naming_it(tmp_path, start_inproc, where):
    if where == "pyproject":
        write(tmp_path / "pyproject.toml", "[tool.forkq]\nconcurrency = 2\nconcurency = 3\n")
        out = start_inproc()
        one_line_error(out, "pyproject.toml", "'concurency'")
    else:
        conf = write(tmp_path / "forkq.toml", "concurrency = 2\nqeue = 'a'\n")
        out = start_inproc("--config", str(conf))
        one_line_error(out, "forkq.toml", "'qeue'")


# (source, what is set, fragments the one-line error must hold: setting, source, what it accepts)
BAD_VALUES = [
    ("env", {"FORKQ_CONCURRENCY": "lots"}, ["FORKQ_CONCURRENCY", "--concurrency", "'lots'", "whole number"]),
    ("env", {"FORKQ_PROCESSES": "0"}, ["FORKQ_PROCESSES", "--processes", "at least 1"]),
    ("env", {"FORKQ_TIMEOUT": "-1"}, ["FORKQ_TIMEOUT", "--timeout", "above 0"]),
    ("env", {"FORKQ_QUEUE": "ok a,0"}, ["FORKQ_QUEUE", "--queue", "a,0", "weight"]),
    ("env", {"FORKQ_NO_FORK": "maybe"}, ["FORKQ_NO_FORK", "--no-fork", "true or false"]),
    ("env", {"FORKQ_LOG_LEVEL": "loud"}, ["FORKQ_LOG_LEVEL", "--log-level", "debug, info, warning"]),
    ("env", {"FORKQ_MAX_MEMORY": "lots"}, ["FORKQ_MAX_MEMORY", "--max-memory", "number"]),
    ("file", "concurrency = 'lots'", ["forkq.toml", "--concurrency", "whole number"]),
    ("file", "concurrency = 2.5", ["forkq.toml", "--concurrency", "whole number"]),
    ("file", "timeout = 0", ["forkq.toml", "--timeout", "above 0"]),
    ("file", "queue = ['a,x']", ["forkq.toml", "--queue", "a,x", "weight"]),
    ("file", "queue = [3]", ["forkq.toml", "--queue", "string"]),
    ("file", "log-level = 'LOUD'", ["forkq.toml", "--log-level", "debug, info, warning"]),
    ("file", "max-memory = -5", ["forkq.toml", "--max-memory", "above 0"]),
    ("file", "no-fork = 'maybe'", ["forkq.toml", "--no-fork", "true or false"]),
    ("file", "tag = 3", ["forkq.toml", "--tag", "string"]),
    ("flag", ["-c", "0"], ["--concurrency", "at least 1"]),
    ("flag", ["--timeout", "soon"], ["--timeout", "'soon'", "number"]),
    ("flag", ["--log-level", "loud"], ["--log-level", "debug, info, warning"]),
    ("flag", ["--max-memory", "0"], ["--max-memory", "above 0"]),
    ("flag", ["-q", "a,0"], ["--queue", "a,0", "weight"]),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source, value, expected", BAD_VALUES,
                         ids=[f"{s}-{v}" for s, v, _ in BAD_VALUES])
def test_bad_value_fails_in_one_line_naming_setting_source_and_accepted(tmp_path, start_inproc, source,
                                                                        value, expected):
    one_line_error(start_inproc(*_bad_args(tmp_path, source, value), env=_bad_env(source, value)), *expected)


def _bad_args(tmp_path, source, value):
    if source == "file":
        return ["--config", str(write(tmp_path / "forkq.toml", value + "\n"))]
    return value if source == "flag" else []


def _bad_env(source, value):
    return value if source == "env" else {}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source", ["env", "file", "flag"])
def test_bad_value_end_to_end(tmp_path, source):
    # the same checks through a real `python -m forkq` process: exit status, stderr, no traceback
    (case,) = [c for c in BAD_VALUES if c[0] == source][:1]
    _, value, expected = case
    one_line_error(run_start(tmp_path, *_bad_args(tmp_path, source, value), env=_bad_env(source, value)),
                   *expected)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source", ["pyproject", "config"])
def test_a_toml_boolean_is_not_a_number(tmp_path, start_inproc, source):
    # TOML true is a bool, and Python's bool is an int: `concurrency = true` must not mean 1
    if source == "pyproject":
        write(tmp_path / "pyproject.toml", "[tool.forkq]\nconcurrency = true\n")
        one_line_error(start_inproc(), "pyproject.toml", "--concurrency", "whole number")
    else:
        conf = write(tmp_path / "forkq.toml", "timeout = true\n")
        one_line_error(start_inproc("--config", str(conf)), "forkq.toml", "--timeout", "number")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source", ["env", "file"])
def test_an_empty_queue_list_is_refused(tmp_path, start_inproc, source):
    # no queue at all would start workers that never take a job
    if source == "env":
        out = start_inproc(env={"FORKQ_QUEUE": "  "})
        one_line_error(out, "FORKQ_QUEUE", "--queue")
    else:
        conf = write(tmp_path / "forkq.toml", "queue = []\n")
        one_line_error(start_inproc("--config", str(conf)), "forkq.toml", "--queue")


@pytest.mark.timeout(30)
def test_one_setting_spelled_twice_in_a_file_is_refused(tmp_path, start_inproc):
    conf = write(tmp_path / "forkq.toml", 'queue = ["a"]\nqueues = ["b"]\n')
    one_line_error(start_inproc("--config", str(conf)), "forkq.toml", "queue", "queues")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["missing", "directory", "not-toml", "not-utf8", "section-not-table"])
def test_unreadable_config_file_fails_in_one_line(tmp_path, start_inproc, case):
    if case == "missing":
        path = tmp_path / "nope.toml"
    elif case == "directory":
        path = tmp_path / "conf.d"
        path.mkdir()
    elif case == "not-toml":
        path = write(tmp_path / "forkq.toml", "concurrency = = 3\n")
    elif case == "not-utf8":
        path = tmp_path / "forkq.toml"
        path.write_bytes(b"concurrency = 3\n# caf\xe9\n")
    else:
        path = write(tmp_path / "pyproject.toml", "[tool]\nforkq = 3\n")
    one_line_error(start_inproc("--config", str(path)), path.name)


# -- a value set explicitly to empty is a mistake, not the default ------------------------------

# (source, what is set, fragments of the one-line error: the source, then the setting)
EMPTY_VALUES = [
    ("env", {"FORKQ_REDIS_URL": ""}, ["FORKQ_REDIS_URL=''", "--redis-url", "must not be empty"]),
    ("env", {"FORKQ_REDIS_URL": " \n"}, ["FORKQ_REDIS_URL=", "--redis-url", "must not be empty"]),
    ("env", {"FORKQ_PIDFILE": ""}, ["FORKQ_PIDFILE=''", "--pidfile", "must not be empty"]),
    ("env", {"FORKQ_REQUIRE": ""}, ["FORKQ_REQUIRE=''", "--require", "must not be empty"]),
    ("env", {"FORKQ_LOG_FORMAT": ""}, ["FORKQ_LOG_FORMAT=''", "--log-format", "must not be empty"]),
    ("env", {"FORKQ_CONFIG": ""}, ["FORKQ_CONFIG=''", "must not be empty"]),
    ("file", 'redis-url = ""', ["forkq.toml", "redis-url = ''", "--redis-url", "must not be empty"]),
    ("file", 'pidfile = ""', ["forkq.toml", "--pidfile", "must not be empty"]),
    ("file", 'require = ["app.jobs", ""]', ["forkq.toml", "--require", "must not be empty"]),
    ("flag", ["--redis-url", ""], ["--redis-url", "must not be empty"]),
    ("flag", ["--pidfile", ""], ["--pidfile", "must not be empty"]),
    ("flag", ["-r", ""], ["--require", "must not be empty"]),
    ("flag", ["--config", ""], ["--config", "must not be empty"]),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source, value, expected", EMPTY_VALUES,
                         ids=[f"{s}-{v}" for s, v, _ in EMPTY_VALUES])
def test_a_value_set_empty_is_refused_naming_setting_and_source(tmp_path, start_inproc, source, value,
                                                               expected):
    # an empty Redis URL used to mean localhost: a secret that resolved to nothing must
    # stop the start, not send the workers to another Redis
    one_line_error(start_inproc(*_bad_args(tmp_path, source, value), env=_bad_env(source, value)), *expected)


@pytest.mark.timeout(30)
def test_a_value_set_empty_is_refused_end_to_end(tmp_path):
    one_line_error(run_start(tmp_path, env={"FORKQ_REDIS_URL": ""}), "FORKQ_REDIS_URL", "--redis-url")


@pytest.mark.timeout(30)
def test_empty_is_a_value_of_its_own_for_the_tag_and_a_switch(tmp_path, start_inproc):
    write(tmp_path / "pyproject.toml", '[tool.forkq]\ntag = "file"\nno-fork = true\n')
    got = parse_config(start_inproc(env={"FORKQ_TAG": "", "FORKQ_NO_FORK": ""}))
    assert got["tag"] == ("", "env") and got["no-fork"] == (False, "env")


# -- the Redis password is masked, whatever the source -----------------------------------------



@pytest.mark.timeout(30)
@pytest.mark.parametrize("source", ["flag", "env", "pyproject", "config"])
def test_print_config_masks_the_redis_password(tmp_path, start_inproc, source):
    args, env = [], {}
    if source == "flag":
        args = ["--redis-url", URL]
    elif source == "env":
        env = {"FORKQ_REDIS_URL": URL}
    elif source == "pyproject":
        write(tmp_path / "pyproject.toml", f'[tool.forkq]\nredis-url = "{URL}"\n')
    else:
        args = ["--config", str(write(tmp_path / "forkq.toml", f'redis_url = "{URL}"\n'))]
    out = start_inproc(*args, env=env)
    value, _ = parse_config(out)["redis-url"]
    assert value == "redis://forkquser:***@127.0.0.1:6399/0"
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url, masked", [
    (f"redis://:{SECRET}@127.0.0.1:6399/0", "redis://:***@127.0.0.1:6399/0"),
    (f"rediss://default:{SECRET}%40x@cache.example:6380/1", "rediss://default:***@cache.example:6380/1"),
    (f"unix://:{SECRET}@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
])
def test_print_config_masks_password_only_and_encoded_forms(tmp_path, start_inproc, url, masked):
    out = start_inproc(env={"FORKQ_REDIS_URL": url})
    assert parse_config(out)["redis-url"] == (masked, "env")
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.timeout(30)
def test_bad_redis_url_value_in_a_file_does_not_show_the_password(tmp_path, start_inproc):
    conf = write(tmp_path / "forkq.toml", f'redis-url = ["{URL}"]\n')
    out = start_inproc("--config", str(conf))
    one_line_error(out, "forkq.toml", "--redis-url", "string")
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.timeout(30)
def test_print_config_masks_a_password_given_in_the_query_string(tmp_path, start_inproc):
    out = start_inproc(env={"FORKQ_REDIS_URL": f"redis://127.0.0.1:6399/0?password={SECRET}"})
    parse_config(out)
    assert SECRET not in out.stdout + out.stderr


# -- the default --processes -------------------------------------------------------------


def _cgroup(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    listing = tmp_path / "self_cgroup"
    listing.write_text(self_cgroup)
    return str(root), str(listing)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("listing, files, quota", [
    # v2: the pod's limit binds though the container's own says "max"
    ("0::/kubepods/pod1/ctr\n", {"kubepods/pod1/cpu.max": "150000 100000\n",
                                 "kubepods/pod1/ctr/cpu.max": "max 100000\n"}, 1.5),
    # v2 inside a container: its cgroup is mounted as the root, listed as "/"
    ("0::/\n", {"cpu.max": "50000 100000\n"}, 0.5),
    # v2 listed under a path the container's mount does not have: the mount's own counts
    ("0::/system.slice/docker-abc.scope\n", {"cpu.max": "200000 100000\n"}, 2.0),
    # v1, hybrid with a v2 line that limits nothing
    ("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}, 3.0),
    ("3:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                           "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    ("0::/\n", {"cpu.max": "a quarter\n"}, None),
    ("0::/\n", {}, None),
])
def test_the_cgroup_cpu_quota_is_read_from_v1_and_v2(tmp_path, listing, files, quota):
    from forkq.settings import cgroup_cpu_quota, usable_cpus
    root, self_cgroup = _cgroup(tmp_path, listing, files)
    assert cgroup_cpu_quota(root, self_cgroup) == quota
    cpus = len(os.sched_getaffinity(0))
    expected = cpus if quota is None else min(cpus, max(1, -(-quota // 1)))
    assert usable_cpus(root, self_cgroup) == expected


@pytest.mark.timeout(20)
def test_the_default_processes_follow_the_cpus_this_process_may_use(tmp_path):
    """os.cpu_count() counts the machine: under taskset, a cpuset or a container's CPU
    limit, forkq forked a child per core it could not use."""
    one = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-m", "forkq", "start", "--print-config"],
                         cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=20,
                         stdin=subprocess.DEVNULL, preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert parse_config(out)["processes"] == (1, "default")
