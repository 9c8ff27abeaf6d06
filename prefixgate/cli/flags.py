"""The one flags helper of the `prefixgate` command: every flag has an environment variable.

`flag(parser, "--name", ...)` adds `--name` whose default is $PREFIXGATE_NAME when that is
set (else `default`); a flag on the command line wins over the variable. Those variables
are the serving commands' (worker, gateway, up: a deployment's settings). A client or
measurement command (chat, replay, token) reads variables of its own instead,
PREFIXGATE_<COMMAND>_NAME (`own_variables(parser, "chat")` before its first flag): the
same name meaning one thing to `up` and another to `replay` (PREFIXGATE_MAX_PROMPT_TOKENS,
PREFIXGATE_NAMESPACE, PREFIXGATE_SEED) would otherwise reach a command it was not
exported for and change what it does, unseen. The variable's
value goes through the same `type` and `choices` as the flag. A value that does not
(PREFIXGATE_PORT=abc, PREFIXGATE_POLICY=fastest) is not an error while the parser is
built, so `--help` and the other commands still work; it becomes a usage error naming the
variable when a command that reads it runs without the flag given.

Kinds of flag:
  * plain: one value of `type`;
  * `action="store_true"`: the variable is 1/true/yes/on or 0/false/no/off/empty;
  * `action="append"`: repeatable, each use and the variable comma-separated (unless
    `comma_separated=False`: free text such as chat messages, the variable is one item);
    the result is always a flat list (the command line replaces the variable's list, it
    does not add to it).

`Parser` is the ArgumentParser that reports such bad variables; subcommands' parsers are
of the same class.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


SERVING_PREFIX = "PREFIXGATE_"


def env_name(flag_name: str, prefix: str = SERVING_PREFIX) -> str:
    """--kv-cache-memory -> PREFIXGATE_KV_CACHE_MEMORY (`prefix`: a parser's
    `env_prefix`, e.g. PREFIXGATE_CHAT_)."""
    return prefix + flag_name.lstrip("-").replace("-", "_").upper()


def env_prefix(parser: argparse.ArgumentParser) -> str:
    """The prefix of the variables of `parser`'s flags."""
    return getattr(parser, "env_prefix", SERVING_PREFIX)


def own_variables(parser: argparse.ArgumentParser, command: str) -> None:
    """Give the flags added to `parser` from now on variables of `command`'s own:
    PREFIXGATE_<COMMAND>_<FLAG>, not the serving commands' PREFIXGATE_<FLAG>."""
    parser.env_prefix = f"{SERVING_PREFIX}{command.upper()}_"  # type: ignore[attr-defined]


class BadEnv:
    """The default of a flag whose environment variable could not be used."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"BadEnv({self.message!r})"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that fails with a clear message on a bad PREFIXGATE_* variable that
    the parsed command would use."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, rest = super().parse_known_args(args, namespace)
        for value in vars(parsed).values():
            if isinstance(value, BadEnv):
                self.error(value.message)
        return parsed, rest

    def add_argument_group(self, *args, **kwargs):  # type: ignore[override]
        group = super().add_argument_group(*args, **kwargs)
        group.env_prefix = env_prefix(self)  # its flags' variables are the parser's
        return group


class _Extend(argparse.Action):
    """append, flattened over commas; the first use on the command line replaces the
    default (the variable's list) instead of adding to it."""

    def __init__(self, *args, item_type: Callable = str, comma_separated: bool = True,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.item_type = item_type
        self.comma_separated = comma_separated

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is self.default or current is None else list(current)
        for v in (v.strip() for v in values.split(",")) if self.comma_separated else [values]:
            if not v:
                continue
            try:
                items.append(self.item_type(v))
            except argparse.ArgumentTypeError as exc:  # the type says what is wrong
                parser.error(f"argument {option_string}: {exc}")
            except (TypeError, ValueError):
                parser.error(f"argument {option_string}: invalid "
                             f"{_type_name(self.item_type)} value: {v!r}")
        setattr(namespace, self.dest, items)


def _type_name(type_: Callable) -> str:
    return getattr(type_, "__name__", "value")


def _from_env(env: str, raw: str, name: str, type_: Callable,
              choices: Sequence[Any] | None, item: str | None = None) -> Any:
    """The flag's value from its variable (or from `item`, one of the variable's
    comma-separated values), or a BadEnv saying what is wrong with it."""
    value_text = raw if item is None else item
    what = "" if item is None else f" ({item!r})"
    try:
        value = type_(value_text)
    except argparse.ArgumentTypeError as exc:  # the type says what is wrong itself
        return BadEnv(f"{env}: {exc} (it sets {name}); fix or unset the variable")
    except (TypeError, ValueError):
        return BadEnv(f"{env}={raw!r} is not a valid {_type_name(type_)}{what} (it sets "
                      f"{name}); fix or unset the variable")
    if choices is not None and value not in choices:
        return BadEnv(f"{env}={raw!r} is not one of {', '.join(map(str, choices))}{what} (it "
                      f"sets {name}); fix or unset the variable")
    return value


def flag(parser: argparse.ArgumentParser, name: str, *, help: str, type: Callable = str,
         default: Any = None, action: str | None = None,
         choices: Sequence[Any] | None = None, comma_separated: bool = True) -> None:
    """Add `--name` to `parser`, defaulting to $PREFIXGATE_NAME (or the parser's own
    prefix's variable: `own_variables`) when that is set."""
    env = env_name(name, env_prefix(parser))
    raw = os.environ.get(env)
    if action == "store_true":
        if raw is None:
            value: Any = bool(default)
        elif raw.strip().lower() in TRUE + FALSE:
            value = raw.strip().lower() in TRUE
        else:
            value = BadEnv(f"{env}={raw!r} is not a boolean (1/true/yes/on or "
                           f"0/false/no/off; it sets {name}); fix or unset the variable")
        parser.add_argument(name, action="store_true", default=value, help=f"{help} [env {env}]")
        return
    if action == "append":
        value = list(default or [])
        if raw is not None:
            items = [v.strip() for v in raw.split(",") if v.strip()] if comma_separated \
                else [raw]
            converted = [_from_env(env, raw, name, type, choices, v) for v in items]
            bad = [v for v in converted if isinstance(v, BadEnv)]
            value = bad[0] if bad else converted
        commas = ", comma-separated" if comma_separated else ""
        parser.add_argument(name, action=_Extend, item_type=type, default=value,
                            comma_separated=comma_separated,
                            help=f"{help} (repeatable{commas}) [env {env}{commas}]")
        return
    if action is not None:
        raise ValueError(f"flag(): unsupported action {action!r}")
    value = default if raw is None else _from_env(env, raw, name, type, choices)
    shown = f" (default: {default})" if default not in (None, "") else ""
    parser.add_argument(name, type=type, default=value, choices=choices,
                        help=f"{help}{shown} [env {env}]")
