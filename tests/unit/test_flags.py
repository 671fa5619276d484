"""--config FILE, the environment and the flags: precedence, unknown keys, types, help."""

from pathlib import Path

import pytest

from kvfleet_common.flags import FlagParser


def _parser(environ: dict[str, str]) -> FlagParser:
    p = FlagParser(prog="svc", environ=environ)
    p.add_argument("--port", type=int, env="SVC_PORT", default=1, help="the port")
    p.add_argument("--kv-policy", env="SVC_POLICY", default="reserve", choices=["reserve", "preempt"])
    p.add_argument("--workers", env="SVC_WORKERS", default="")
    p.add_argument("--drain", type=float, default=10.0)
    p.add_argument("--open", action="store_true", env="SVC_OPEN")
    p.add_logging_flags()
    return p


def _toml(tmp_path: Path, text: str, name: str = "c.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "env, file, flags, want",
    [
        ({}, None, [], 1),  # default
        ({"SVC_PORT": "2"}, None, [], 2),  # environment over default
        ({"SVC_PORT": "2"}, "port = 3", [], 3),  # file over environment
        ({"SVC_PORT": "2"}, "port = 3", ["--port", "4"], 4),  # flag over file
        ({}, None, ["--port", "4"], 4),
        ({}, "port = 3", [], 3),
    ],
)
def test_precedence_flag_file_environment_default(tmp_path, env, file, flags, want):
    argv = (["--config", _toml(tmp_path, file)] if file else []) + flags
    assert _parser(env).parse_args(argv).port == want


def test_file_keys_with_dashes_or_underscores_and_typed_values(tmp_path):
    path = _toml(
        tmp_path,
        'kv-policy = "preempt"\nlog_format = "json"\ndrain = 2\nopen = true\n'
        'workers = ["a:1", "b:2"]\nlog-level = "debug"\n',
    )
    a = _parser({}).parse_args(["--config", path])
    assert (a.kv_policy, a.log_format, a.drain, a.open, a.workers, a.log_level) == (
        "preempt",
        "json",
        2.0,
        True,
        "a:1,b:2",
        "DEBUG",
    )
    assert isinstance(a.drain, float)


def test_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("port: 7\nkv-policy: preempt\n")
    a = _parser({}).parse_args(["--config", str(path)])
    assert (a.port, a.kv_policy) == (7, "preempt")


@pytest.mark.parametrize(
    "text, says",
    [
        ("prot = 3", "unknown key 'prot'"),
        ("config = 'x.toml'", "unknown key 'config'"),
        ('port = "many"', "port: invalid value 'many'"),
        ("port = 1.5", "port: expected an integer"),
        ('kv-policy = "sometimes"', "'sometimes' is not one of reserve, preempt"),
        ("open = 3", "open: expected true or false"),
        ("port = true", "port: expected a value"),
        ("port = [", "not valid TOML"),
    ],
)
def test_bad_files_are_errors_naming_the_key(tmp_path, capsys, text, says):
    with pytest.raises(SystemExit) as exc:
        _parser({}).parse_args(["--config", _toml(tmp_path, text)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "c.toml" in err


def test_missing_or_misnamed_file(tmp_path, capsys):
    for path, says in ((tmp_path / "none.toml", "No such file"), (tmp_path / "c.ini", "name it .toml")):
        if path.suffix == ".ini":
            path.write_text("")
        with pytest.raises(SystemExit):
            _parser({}).parse_args(["--config", str(path)])
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("env, want_open", [({"SVC_OPEN": "true"}, True), ({"SVC_OPEN": "0"}, False), ({}, False)])
def test_switches_from_the_environment(env, want_open):
    assert _parser(env).parse_args([]).open is want_open


def test_bad_environment_value_names_the_variable(capsys):
    with pytest.raises(SystemExit):
        _parser({"SVC_PORT": "eighty"}).parse_args([])
    assert "environment SVC_PORT" in capsys.readouterr().err


def test_help_names_each_flags_environment_variable(capsys):
    with pytest.raises(SystemExit):
        _parser({}).parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for var in ("SVC_PORT", "SVC_POLICY", "SVC_OPEN", "KVFLEET_LOG_LEVEL", "KVFLEET_LOG_FORMAT"):
        assert f"[env {var}]" in out
    assert "the port [env SVC_PORT]" in out and "--config FILE" in out


@pytest.mark.parametrize(
    "module, more",
    [("scheduler_svc", 'workers = ["127.0.0.1:1"]'), ("worker_svc", ""), ("telemetry_svc", ""), ("gateway_svc", "")],
)
def test_every_service_takes_a_config_file_and_the_log_flags(tmp_path, module, more):
    import importlib

    from kvfleet_common.logs import setup_logging

    parse_args = importlib.import_module(f"{module}.__main__").parse_args
    path = _toml(tmp_path, f'log-format = "json"\nlog-level = "WARNING"\nport = 12345\n{more}\n')
    got = parse_args(["--config", path])
    config, logs = got if isinstance(got, tuple) else (got, None)
    assert config.port == 12345
    if logs is not None:
        assert (logs.level, logs.format) == ("WARNING", "json")
    with pytest.raises(SystemExit):
        parse_args(["--config", _toml(tmp_path, "no-such-flag = 1", "bad.toml")])
    setup_logging("WARNING", "text")  # the scheduler's and worker's parse_args set it up
