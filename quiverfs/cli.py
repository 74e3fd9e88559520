"""The ``quiver`` command: one entry point, one subcommand per task."""
from __future__ import annotations

import argparse
import logging
import sys

from quiverfs import __version__, config
from quiverfs.errors import ExitCode, QuietError, quiet_error_in

EPILOG = """exit codes: 0 ok, 1 verify/diff found differences, 2 bad usage, 3 not found,
4 bad digest, 5 bad input, 6 permission or credentials, 7 storage unreachable,
8 daemon not running or refused, 9 mount root problem, 10 config file problem.
See docs/cli.md; the config file is described in docs/operations.md."""


def build_parser() -> argparse.ArgumentParser:
    from coordinator import cli as coordinator_cli
    from coordinator.embedded import EmbeddedCoordinator
    from digest_tools import cli as digest_cli
    from mountd import cli as mountd_cli
    from quiverfs.bench import cli as bench_cli

    parser = argparse.ArgumentParser(
        prog="quiver", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Quiver: a content-addressed SSD cache for training data, mounted as "
        "a filesystem. Typical use: 'quiver digest create DIR -o d.qd', start "
        "'quiver mountd --root /mnt/quiver ...', then 'quiver mount d.qd' and read "
        "/mnt/quiver/NAME.")
    parser.add_argument("--version", action="version", version=f"quiver {__version__}")
    parser.add_argument("--log-level", default=None,
                        choices=["debug", "info", "warning", "error"],
                        help="logging verbosity (default: warning; info for daemons)")
    parser.add_argument("--config", metavar="FILE",
                        help=f"config file (default: ${config.PATH_VARIABLE} or "
                        f"{config.DEFAULT_PATH}, if it exists)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    digest_cli.add_parsers(sub)
    mountd_cli.add_parsers(sub, embedded_coordinator=EmbeddedCoordinator)
    coordinator_cli.add_parsers(sub)
    bench_cli.add_parsers(sub)
    return parser


def setup_logging(level: str | None, daemon: bool) -> None:
    default = logging.INFO if daemon else logging.WARNING
    logging.basicConfig(
        level=getattr(logging, level.upper()) if level else default,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if daemon
        else "quiver: %(levelname)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    try:
        args = config.parse_args(build_parser(), argv)
        setup_logging(args.log_level, daemon=getattr(args, "daemon", False))
        return int(args.func(args))
    except QuietError as exc:
        return _print_error(exc)
    except BaseExceptionGroup as group:  # a daemon's task: trio wraps what it raised
        quiet = quiet_error_in(group)
        if quiet is None:
            raise
        return _print_error(quiet)
    except KeyboardInterrupt:
        print("quiver: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return int(ExitCode.OK)



def _print_error(exc: QuietError) -> int:
    print(f"quiver: error: {exc.message}", file=sys.stderr)
    return int(exc.exitcode)


if __name__ == "__main__":
    sys.exit(main())
