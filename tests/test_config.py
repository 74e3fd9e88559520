"""The config file through the real CLI: precedence, and every kind of bad file."""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from quiverfs import config
from quiverfs.cli import build_parser
from quiverfs.errors import ExitCode
from tests.test_digest_errors import assert_error


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No config or root from the environment running the tests."""
    monkeypatch.delenv(config.PATH_VARIABLE, raising=False)
    monkeypatch.delenv("QUIVER_ROOT", raising=False)


def write(tmp_path, text: str, name: str = "quiver.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


@pytest.fixture
def small_tree(tmp_path) -> str:
    """Three files in two class directories."""
    for rel, data in (("a/1.jpg", b"one"), ("a/2.jpg", b"two"), ("b/3.jpg", b"three")):
        path = tmp_path / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return str(tmp_path / "src")


# -- precedence ---------------------------------------------------------------------------
def test_required_mountd_options_come_from_the_file(quiver, tmp_path):
    cache = tmp_path / "cache"
    cfg = write(tmp_path, f"""
        root = "{tmp_path}/no-such-root"
        [mountd]
        cache-dir = "{cache}"
        cache-size = "64M"
        """)
    r = quiver("--config", cfg, "mountd", "--foreground")
    # Past argparse (--cache-dir and --cache-size are required) and into the command:
    # it made the cache directory, then found the root from the top level missing.
    assert_error(r, ExitCode.MOUNT, f"{tmp_path}/no-such-root does not exist")
    assert cache.is_dir()


def test_command_line_beats_environment_beats_file(quiver, tmp_path, monkeypatch):
    cfg = write(tmp_path, f'root = "{tmp_path}/from-file"\n')
    assert_error(quiver("--config", cfg, "status"), ExitCode.DAEMON,
                 f"no mountd is running for {tmp_path}/from-file ")
    monkeypatch.setenv("QUIVER_ROOT", f"{tmp_path}/from-env")
    assert_error(quiver("--config", cfg, "status"), ExitCode.DAEMON,
                 f"for {tmp_path}/from-env ")
    assert_error(quiver("--config", cfg, "status", "--root", f"{tmp_path}/cli"),
                 ExitCode.DAEMON, f"for {tmp_path}/cli ")


def test_a_root_too_long_for_its_default_socket_is_one_line(quiver, tmp_path):
    """The default control socket's path holds the root's; past what a socket address
    holds, connecting fails before any mountd is asked. Before: a traceback (OSError:
    AF_UNIX path too long)."""
    root = f"{tmp_path}/{'r' * 120}"
    assert_error(quiver("status", "--root", root), ExitCode.DAEMON,
                 "AF_UNIX path too long: give --control-socket a shorter path")


def test_a_command_table_beats_the_top_level(quiver, tmp_path):
    cfg = write(tmp_path, f"""
        root = "{tmp_path}/top"
        control-socket = "{tmp_path}/top.sock"
        [status]
        root = "{tmp_path}/status-root"
        """)
    assert_error(quiver("--config", cfg, "status"), ExitCode.DAEMON,
                 f"for {tmp_path}/status-root (no control socket {tmp_path}/top.sock)")
    assert_error(quiver("--config", cfg, "umount", "x"), ExitCode.DAEMON,
                 f"for {tmp_path}/top (no control socket {tmp_path}/top.sock)")


def test_digest_options_from_the_file_and_the_command_line(quiver, tmp_path, small_tree):
    out = tmp_path / "from-file.qd"
    cfg = write(tmp_path, f"""
        [digest]
        workers = 2
        [digest.create]
        output = "{out}"
        name = "from-file"
        label-level = 0
        [digest.show]
        json = true
        """)
    r = quiver("--config", cfg, "digest", "create", small_tree)  # no -o: the file's
    assert r.returncode == 0, r.stderr
    shown = json.loads(quiver("--config", cfg, "digest", "show", str(out)).stdout)
    assert (shown["name"], shown["items"], shown["labels"]) == ("from-file", 3, 0)

    r = quiver("--config", cfg, "digest", "create", small_tree, "--name", "from-cli",
               "--label-level", "1")
    assert r.returncode == 0, r.stderr
    shown = json.loads(quiver("--config", cfg, "digest", "show", str(out)).stdout)
    assert (shown["name"], shown["labels"]) == ("from-cli", 2)


def test_config_file_from_the_environment_and_the_option(quiver, tmp_path, monkeypatch):
    env_cfg = write(tmp_path, f'root = "{tmp_path}/env-file"\n', "env.toml")
    cli_cfg = write(tmp_path, f'root = "{tmp_path}/cli-file"\n', "cli.toml")
    monkeypatch.setenv(config.PATH_VARIABLE, env_cfg)
    assert_error(quiver("status"), ExitCode.DAEMON, f"for {tmp_path}/env-file ")
    assert_error(quiver("--config", cli_cfg, "status"), ExitCode.DAEMON,
                 f"for {tmp_path}/cli-file ")


def test_missing_default_file_is_fine(quiver, tmp_path, small_tree):
    if os.path.exists(config.DEFAULT_PATH):
        pytest.skip(f"{config.DEFAULT_PATH} exists on this machine")
    assert config.read(config.DEFAULT_PATH, origin="") == {}
    r = quiver("digest", "create", small_tree, "-o", str(tmp_path / "d.qd"))
    assert r.returncode == 0, r.stderr


def test_log_level_per_command_table(tmp_path, monkeypatch):
    cfg = write(tmp_path, """
        log-level = "error"
        [mountd]
        log-level = "debug"
        """)
    monkeypatch.setenv(config.PATH_VARIABLE, cfg)
    mountd = config.parse_args(build_parser(), ["mountd", "--cache-dir", "c",
                                                "--cache-size", "1G"])
    status = config.parse_args(build_parser(), ["status"])
    cli = config.parse_args(build_parser(), ["--log-level", "info", "mountd",
                                             "--cache-dir", "c", "--cache-size", "1G"])
    assert (mountd.log_level, status.log_level, cli.log_level) == ("debug", "error", "info")
    assert mountd.cache_size == 1 << 30 and mountd.command_path == ("mountd",)


def test_version_and_help_ignore_a_broken_file(quiver, tmp_path):
    cfg = write(tmp_path, "[mountd\n")
    r = quiver("--config", cfg, "--version")
    assert r.returncode == 0 and r.stdout.startswith("quiver ")
    r = quiver("--config", cfg, "--help")
    assert r.returncode == 0 and "--config FILE" in r.stdout


def test_option_values_are_checked_the_same_on_the_command_line(quiver, tmp_path):
    r = quiver("mountd", "--cache-dir", str(tmp_path), "--cache-size", "0")
    assert_error(r, ExitCode.USAGE, "--cache-size must be positive")
    r = quiver("mountd", "--cache-dir", str(tmp_path), "--cache-size", "1G", "--threads", "0")
    assert_error(r, ExitCode.USAGE, "--threads must be at least 1, not 0")
    r = quiver("mountd", "--cache-dir", str(tmp_path), "--cache-size", "1G",
               "--metrics", "localhost")
    assert_error(r, ExitCode.USAGE, "--metrics", "HOST:PORT")


# -- validation ---------------------------------------------------------------------------
BAD_FILES = [
    ("unknown-key", '[mountd]\ncache_size = "1G"\n',
     ["[mountd] cache_size: unknown key (did you mean cache-size?)"]),
    ("unknown-top-level-key", "bogus = 1\n", ["bogus: unknown key"]),
    ("positional-argument", '[umount]\nname = "x"\n', ["[umount] name: unknown key"]),
    ("the-config-option", 'config = "other.toml"\n', ["config: unknown key"]),
    ("unknown-table", "[mountdd]\n", ["[mountdd]: unknown table (did you mean [mountd]?)"]),
    ("unknown-nested-table", "[digest.creat]\n", ["[digest.creat]: unknown table"]),
    ("command-not-a-table", "status = 1\n", ["status: must be a table ([status])"]),
    ("string-for-integer", '[mountd]\nthreads = "8"\n',
     ["[mountd] threads: must be an integer, not a string"]),
    ("string-for-flag", '[status]\njson = "yes"\n',
     ["[status] json: must be true or false, not a string"]),
    ("integer-for-path", "root = 5\n", ["root: must be a string, not an integer"]),
    ("float-for-size", "[mountd]\ncache-size = 1.5\n",
     ["[mountd] cache-size: must be a string or an integer, not a number"]),
    ("bad-size", '[mountd]\ncache-size = "lots"\n', ["[mountd] cache-size: invalid --cache-size"]),
    ("zero-threads", "[mountd]\nthreads = 0\n",
     ["[mountd] threads: --threads must be at least 1, not 0"]),
    ("bad-choice", 'log-level = "loud"\n', ["log-level: must be one of debug, info"]),
    ("bad-address", '[mountd]\nmetrics = "9100"\n', ["[mountd] metrics:", "HOST:PORT"]),
    ("port-out-of-range", '[mountd]\nmetrics = "127.0.0.1:70000"\n',
     ["[mountd] metrics: --metrics port must be at most 65535"]),
    ("shared-key-bad-for-one-command", "[digest]\nworkers = 0\n",
     ["[digest] workers: --workers must be at least 1", "(for 'quiver digest create')"]),
    ("shared-key-of-two-types", "json = true\n",
     ["json: must be a string, not true or false (for 'quiver bench')"]),
    ("not-toml", "[mountd\n", ["not valid TOML", "line 1"]),
]


@pytest.mark.parametrize("text,words", [(t, w) for _, t, w in BAD_FILES],
                         ids=[name for name, _, _ in BAD_FILES])
def test_bad_file_is_one_line_naming_file_table_and_key(quiver, tmp_path, text, words):
    cfg = write(tmp_path, text)
    assert_error(quiver("--config", cfg, "status"), ExitCode.CONFIG,
                 f"quiver: error: {cfg}: ", *words)


def test_missing_explicit_file_is_an_error(quiver, tmp_path, monkeypatch):
    missing = str(tmp_path / "missing.toml")
    assert_error(quiver("--config", missing, "status"), ExitCode.CONFIG,
                 f"config file {missing} (from --config) does not exist")
    monkeypatch.setenv(config.PATH_VARIABLE, missing)
    assert_error(quiver("status"), ExitCode.CONFIG,
                 f"config file {missing} (from $QUIVER_CONFIG) does not exist")


def test_unreadable_files_are_errors(quiver, tmp_path):
    assert_error(quiver("--config", str(tmp_path), "status"), ExitCode.CONFIG,
                 f"cannot read config file {tmp_path}: Is a directory")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"root = '\xff'\n")
    assert_error(quiver("--config", str(binary), "status"), ExitCode.CONFIG,
                 f"{binary}: not a TOML file (not UTF-8)")
