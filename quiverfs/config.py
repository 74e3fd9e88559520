"""The config file: one TOML file whose tables follow the ``quiver`` commands.

Every long option of every command can be set in it, spelled as on the command line
without the leading dashes (``--cache-size`` is ``cache-size``)::

    root = "/mnt/quiver"         # top level: every command that has --root
    [mountd]                     # `quiver mountd`
    cache-dir = "/var/cache/quiver"
    cache-size = "200G"
    [digest.create]              # `quiver digest create`
    workers = 8

A key applies to every command under its table that has that option: the top level
is the table of all commands, ``[digest]`` that of ``digest create``, ``digest
verify``..., and a deeper table wins. Global options (``log-level``) may be set in any
table. Positional arguments cannot be set. Precedence: the command line, then the
environment (``ENVIRONMENT``), then the file, then the built-in defaults.

The file is ``--config FILE``, else ``$QUIVER_CONFIG``, else /etc/quiver/quiver.toml;
only the last may be missing. The whole file is checked before any command runs: an
unknown table or key, a value of the wrong type or a bad value is one line naming the
file, the table and the key, with exit code CONFIG.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import tomllib
from collections.abc import Iterator, Sequence
from typing import Any

from quiverfs.errors import ExitCode, QuietError

DEFAULT_PATH = "/etc/quiver/quiver.toml"
PATH_VARIABLE = "QUIVER_CONFIG"
# Environment variables that set an option of every command having it. They beat the
# file (a shell's setting is more specific than the machine's) but not the command line.
ENVIRONMENT = {"QUIVER_ROOT": "root"}
CONFIG_DEST = "config"  # the option naming the file cannot be set in it

Values = dict[tuple[str, ...], dict[str, Any]]  # command path -> option key -> value


@dataclasses.dataclass
class Command:
    """A node of the command tree: its table in the file, its options, its subcommands."""

    path: tuple[str, ...]
    parser: argparse.ArgumentParser
    options: dict[str, argparse.Action]  # key in the file -> action
    children: dict[str, Command]

    def leaves(self) -> Iterator[Command]:
        if not self.children:
            yield self
        for child in self.children.values():
            yield from child.leaves()

    def scope(self) -> set[str]:
        """The keys this command's table may hold (besides the global options)."""
        return {key for leaf in self.leaves() for key in leaf.options} | set(self.options)


def command_tree(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Command:
    """The commands under ``parser`` with the options the file may set."""
    options: dict[str, argparse.Action] = {}
    children: dict[str, Command] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                children[name] = command_tree(sub, (*path, name))
        elif _settable(action):
            options[_key(action)] = action
    return Command(path, parser, options, children)


def _settable(action: argparse.Action) -> bool:
    return (bool(action.option_strings) and action.dest != CONFIG_DEST
            and isinstance(action, (argparse._StoreAction, argparse._StoreTrueAction)))


def _key(action: argparse.Action) -> str:
    longs = [s for s in action.option_strings if s.startswith("--")]
    return longs[0][2:] if longs else action.dest.replace("_", "-")


# -- finding and reading the file ---------------------------------------------------------
def locate(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[str | None, str]:
    """The config file to read and where its name came from ("--config", the variable,
    or "" for the default path); None when only help or the version was asked for."""
    # Only the global options before the command are parsed here, the way the real
    # parser will parse them; everything from the command on is left alone.
    pre = argparse.ArgumentParser(prog=parser.prog, add_help=False,
                                  allow_abbrev=parser.allow_abbrev)
    flags = []
    for action in parser._actions:
        if action.option_strings:
            pre.add_argument(*action.option_strings, dest=action.dest,
                             action="store_true" if action.nargs == 0 else "store")
            if action.nargs == 0:
                flags.append(action.dest)
    pre.add_argument("command", nargs=argparse.REMAINDER)
    known, _ = pre.parse_known_args(argv)
    if any(getattr(known, dest) for dest in flags):
        return None, ""
    if getattr(known, CONFIG_DEST, None):
        return getattr(known, CONFIG_DEST), "--config"
    if os.environ.get(PATH_VARIABLE):
        return os.environ[PATH_VARIABLE], f"${PATH_VARIABLE}"
    return DEFAULT_PATH, ""


def read(path: str, origin: str) -> dict[str, Any]:
    """The parsed file; {} when the default file does not exist."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        if not origin:
            return {}
        raise QuietError(f"config file {path} (from {origin}) does not exist",
                         ExitCode.CONFIG) from None
    except OSError as exc:
        raise QuietError(f"cannot read config file {path}: {exc.strerror}",
                         ExitCode.CONFIG) from None
    except UnicodeDecodeError:
        raise QuietError(f"{path}: not a TOML file (not UTF-8)", ExitCode.CONFIG) from None
    except tomllib.TOMLDecodeError as exc:
        raise QuietError(f"{path}: not valid TOML: {exc}", ExitCode.CONFIG) from None


# -- checking and converting values -------------------------------------------------------
def resolve(tree: Command, data: dict[str, Any], path: str) -> Values:
    """Every command's settings from the file, checked and converted."""
    out: Values = {}

    def walk(node: Command, table: dict[str, Any], inherited: dict[str, tuple[Any, Command]]
             ) -> None:
        here = dict(inherited)
        scope = node.scope() | set(tree.options)
        for key, value in table.items():
            if isinstance(value, dict):
                if key not in node.children:
                    near = difflib.get_close_matches(key, sorted(node.children), n=1)
                    hint = f" (did you mean {_table((*node.path, near[0]))}?)" if near else ""
                    raise QuietError(f"{path}: {_table((*node.path, key))}: unknown table"
                                     f"{hint}", ExitCode.CONFIG)
            elif key in scope:
                here[key] = (value, node)
            elif key in node.children:
                raise QuietError(f"{_where(path, node, key)}: must be a table "
                                 f"({_table((*node.path, key))})", ExitCode.CONFIG)
            else:
                near = difflib.get_close_matches(key, sorted(scope), n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise QuietError(f"{_where(path, node, key)}: unknown key{hint}",
                                 ExitCode.CONFIG)
        if not node.children:
            out[node.path] = {}
            for key, (value, origin) in here.items():
                if key in node.options:
                    out[node.path][key] = _checked(node.options[key], value, path, origin, key,
                                                   None if origin is node else node)
                elif key in tree.options:
                    out[node.path][key] = _checked(tree.options[key], value, path, origin, key,
                                                   None)
                # else: an option of another command under the table that set it
        for name, child in node.children.items():
            sub = table.get(name)
            walk(child, sub if isinstance(sub, dict) else {}, here)

    walk(tree, data, {})
    return out


def _table(path: tuple[str, ...]) -> str:
    return f"[{'.'.join(path)}]"


def _where(path: str, node: Command, key: str) -> str:
    return f"{path}: {_table(node.path)} {key}" if node.path else f"{path}: {key}"


def _checked(action: argparse.Action, value: Any, path: str, origin: Command, key: str,
             command: Command | None) -> Any:
    """``convert``, its error naming the file, table and key (and the command the value
    did not suit, when the table is shared)."""
    try:
        return convert(action, value)
    except QuietError as exc:
        scope = f" (for 'quiver {' '.join(command.path)}')" if command is not None else ""
        raise QuietError(f"{_where(path, origin, key)}: {exc.message}{scope}",
                         ExitCode.CONFIG) from None


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          list: "an array", dict: "a table"}


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), "a date or time")


def convert(action: argparse.Action, value: Any) -> Any:
    """``value`` (from TOML or the environment) as ``action`` would take it from the
    command line; QuietError saying what is wrong with it."""
    if isinstance(action, argparse._StoreTrueAction):
        expected: tuple[type, ...] = (bool,)
    else:
        expected = getattr(action.type, "toml_types", None) or {
            int: (int,), float: (int, float)}.get(action.type, (str,))
    if type(value) not in expected:
        raise QuietError(f"must be {' or '.join(_KINDS[t] for t in expected)}, "
                         f"not {_kind(value)}", ExitCode.CONFIG)
    if action.type is not None:
        try:
            value = action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise QuietError(f"invalid value {value!r}: {exc}", ExitCode.CONFIG) from None
    if action.choices is not None and value not in action.choices:
        raise QuietError(f"must be one of {', '.join(map(str, action.choices))}, "
                         f"not {value!r}", ExitCode.CONFIG)
    return value


def _environment(tree: Command, values: Values) -> None:
    """Lay the ENVIRONMENT variables over the file's values."""
    for variable, key in ENVIRONMENT.items():
        text = os.environ.get(variable)
        if not text:
            continue
        for leaf in tree.leaves():
            action = leaf.options.get(key)
            if action is not None:
                try:
                    values[leaf.path][key] = convert(action, text)
                except QuietError as exc:
                    raise QuietError(f"${variable}: {exc.message}", ExitCode.USAGE) from None


# -- parsing ----------------------------------------------------------------------------
def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
               ) -> argparse.Namespace:
    """Parse ``argv`` with the config file's values as the defaults.

    The namespace gets ``command_path``, the command's path (``("digest", "create")``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    tree = command_tree(parser)
    path, origin = locate(parser, argv)
    values = {} if path is None else resolve(tree, read(path, origin), path)
    values = {leaf.path: values.get(leaf.path, {}) for leaf in tree.leaves()}
    _environment(tree, values)
    for leaf in tree.leaves():
        leaf.parser.set_defaults(command_path=leaf.path)
        for key, value in values[leaf.path].items():
            action = leaf.options.get(key)
            if action is not None:  # a required option set in the file is required no more
                action.default, action.required = value, False
    args = parser.parse_args(argv)
    # Global options are parsed before the command is known, so fill them in now.
    mine = values.get(getattr(args, "command_path", ()), {})
    for key, action in tree.options.items():
        if getattr(args, action.dest) is None and key in mine:
            setattr(args, action.dest, mine[key])
    return args
