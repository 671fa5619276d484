"""Command-line flags for the services and `kvfleet up`: argparse plus a config file and the environment.

`FlagParser` is an `argparse.ArgumentParser` whose `add_argument` also takes `env="KVFLEET_..."`
(named in the flag's help) and which, with `config=True`, has `--config FILE`: a TOML (`.toml`)
or YAML (`.yaml`/`.yml`) file of `flag-name = value` (dashes or underscores alike). Where a value
comes from, first match wins:

    the flag on the command line  >  the config file  >  the environment variable  >  the default

The file outranks the environment because it is named on the command line, as explicit as a
flag, while the environment is ambient (a container's or a shell's). A key that is no flag of the
command is an error naming the key, and so is a value of the wrong type or outside the choices.
Values are read when the arguments are parsed, never at import.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvfleet_common.logs import LOG_FORMATS, LOG_LEVELS

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def parse_switch(value: str) -> bool:
    """A true/false setting's text (1/0, true/false, yes/no, on/off; empty: false); ValueError
    for anything else, so that a typo does not quietly mean off."""
    word = value.strip().lower()
    if word in _TRUE + _FALSE:
        return word in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


def load_config_file(path: str) -> dict[str, Any]:
    """The file's top-level table as a dict; ValueError saying what is wrong with it."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"config file {path}: name it .toml, .yaml or .yml (got {suffix or 'no suffix'})")
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"config file {path}: {exc.strerror or exc}") from None
    try:
        if suffix == ".toml":
            doc = tomllib.loads(text)
        else:
            import yaml  # only when a YAML file is given

            doc = yaml.safe_load(text)
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError: both say where
        raise ValueError(f"config file {path}: not valid {suffix[1:].upper()}: {exc}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ValueError(f"config file {path}: expected a table of flag = value, got {type(doc).__name__}")
    return doc


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))


def _coerce(action: argparse.Action, value: Any) -> Any:
    """A file or environment value as the flag would have parsed it; ValueError if it cannot be."""
    if _is_switch(action):
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            return parse_switch(value)
        raise ValueError(f"expected true or false, got {value!r}")
    if isinstance(value, bool):
        raise ValueError(f"expected a value, not {value!r}")
    if isinstance(value, list):  # workers = ["a:1", "b:2"] for a comma-separated flag
        value = ",".join(str(v) for v in value)
    convert: Callable[[Any], Any] = action.type if callable(action.type) else str
    if isinstance(value, float) and convert is int:
        raise ValueError(f"expected an integer, got {value!r}")
    try:
        out = convert(value if isinstance(value, str) or convert in (int, float) else str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"invalid value {value!r}: {exc}") from None
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"{out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def add_switch(p: argparse.ArgumentParser, name: str, default: bool, on: str, off: str, env: str | None = None) -> None:
    """A boolean setting as two flags on one dest, ``--name`` (help ``on``) and ``--no-name``
    (help ``off``), rather than BooleanOptionalAction, which the flag layer's environment and
    config coercion would read as a plain string ("0" would be true). ``env``: a FlagParser's
    variable for it."""
    dest = name.replace("-", "_")
    kwargs: dict[str, Any] = {"env": env} if env else {}
    p.add_argument(f"--{name}", dest=dest, action="store_true", default=default, help=on, **kwargs)
    p.add_argument(f"--no-{name}", dest=dest, action="store_false", help=off)


class FlagParser(argparse.ArgumentParser):
    def __init__(
        self, *args: Any, config: bool = True, environ: Mapping[str, str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._env_of: dict[str, str] = {}  # dest -> its environment variable
        self._environ = environ  # None: os.environ, read at parse time
        self._has_config = config
        if config:
            self.add_argument(
                "--config",
                metavar="FILE",
                default=None,
                help="a TOML or YAML file whose keys are these flags' names; "
                "precedence: flag > file > environment > default",
            )

    def add_argument(self, *args: Any, env: str | None = None, **kwargs: Any) -> argparse.Action:
        if env:
            kwargs["help"] = f"{kwargs['help']} " if kwargs.get("help") else ""
            kwargs["help"] += f"[env {env}]"
        action = super().add_argument(*args, **kwargs)
        if env:
            self._env_of[action.dest] = env
        return action

    def add_logging_flags(self, level: str = "INFO") -> None:
        self.add_argument(
            "--log-level", default=level, type=str.upper, choices=LOG_LEVELS, env="KVFLEET_LOG_LEVEL", help=""
        )
        self.add_argument(
            "--log-format",
            default="text",
            choices=LOG_FORMATS,
            env="KVFLEET_LOG_FORMAT",
            help="text, or json: one object per line with trace_id/span_id and session_id",
        )

    def _flags(self) -> dict[str, argparse.Action]:
        """The actions a file may set, by dest (dashes and underscores both map to it)."""
        return {
            a.dest: a
            for a in self._actions
            if a.option_strings and a.dest not in ("help", "version", "config") and a.default != argparse.SUPPRESS
        }

    def _layered_defaults(self, config_path: str | None) -> dict[str, Any]:
        flags = self._flags()
        environ = os.environ if self._environ is None else self._environ
        out: dict[str, Any] = {}
        for dest, var in self._env_of.items():
            if var in environ and dest in flags:
                try:
                    out[dest] = _coerce(flags[dest], environ[var])
                except ValueError as exc:
                    self.error(f"environment {var}: {exc}")
        if config_path:
            try:
                doc = load_config_file(config_path)
            except ValueError as exc:
                self.error(str(exc))
            for key, value in doc.items():
                dest = str(key).lstrip("-").replace("-", "_")
                if dest not in flags:
                    self.error(
                        f"config file {config_path}: unknown key {key!r} "
                        f"(known: {', '.join(sorted(d.replace('_', '-') for d in flags))})"
                    )
                try:
                    out[dest] = _coerce(flags[dest], value)
                except ValueError as exc:
                    self.error(f"config file {config_path}: {key}: {exc}")
        return out

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        # Called by parse_args, and by a parent parser's subcommand action with this parser's
        # own arguments: the one place to lay the file and the environment under the flags.
        config_path = None
        if self._has_config:
            pre = argparse.ArgumentParser(add_help=False)
            pre.add_argument("--config", default=None)
            config_path = pre.parse_known_args(args)[0].config
        layered = self._layered_defaults(config_path)
        if namespace is None:
            namespace = argparse.Namespace()
        for dest, value in layered.items():
            # set on the namespace, not as defaults: argparse would run a string default
            # through `type` a second time.
            setattr(namespace, dest, value)
        return super().parse_known_args(args, namespace)
