"""Typed option values: argparse ``type=`` converters that the config file reuses.

A converter raises QuietError (exit USAGE) naming its option, so a bad value is
reported on one line whether it came from the command line or from the config file
(which adds the file, table and key). ``toml_types`` says which TOML value types the
config file may give it (see quiverfs.config).
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from quiverfs.errors import ExitCode, QuietError
from quiverfs.sizes import parse_size


@dataclasses.dataclass(frozen=True)
class IntAtLeast:
    """An integer of at least ``minimum`` (and at most ``maximum``, when given)."""

    option: str
    minimum: int
    maximum: int | None = None
    toml_types: ClassVar[tuple[type, ...]] = (int,)

    def __call__(self, value: str | int) -> int:
        try:
            n = int(value)
        except ValueError:
            raise QuietError(f"{self.option} must be an integer, not {value!r}",
                             ExitCode.USAGE) from None
        if n < self.minimum:
            raise QuietError(f"{self.option} must be at least {self.minimum}, not {n}",
                             ExitCode.USAGE)
        if self.maximum is not None and n > self.maximum:
            raise QuietError(f"{self.option} must be at most {self.maximum}, not {n}",
                             ExitCode.USAGE)
        return n


@dataclasses.dataclass(frozen=True)
class FloatAtLeast:
    """A finite number of at least ``minimum`` (above it, when not ``minimum_ok``): a
    duration or a rate, where NaN or infinity would silently turn a check off."""

    option: str
    minimum: float
    minimum_ok: bool = True
    toml_types: ClassVar[tuple[type, ...]] = (int, float)

    def __call__(self, value: str | float) -> float:
        try:
            x = float(value)
        except ValueError:
            raise QuietError(f"{self.option} must be a number, not {value!r}",
                             ExitCode.USAGE) from None
        if not math.isfinite(x):
            raise QuietError(f"{self.option} must be a finite number, not {value!r}",
                             ExitCode.USAGE)
        if x < self.minimum or (x == self.minimum and not self.minimum_ok):
            least = "at least" if self.minimum_ok else "more than"
            raise QuietError(f"{self.option} must be {least} {self.minimum:g}, not {x:g}",
                             ExitCode.USAGE)
        return x


@dataclasses.dataclass(frozen=True)
class ByteSize:
    """A positive number of bytes (or none, with ``zero_ok``), written like ``200G``
    (or a plain integer)."""

    option: str
    zero_ok: bool = False
    toml_types: ClassVar[tuple[type, ...]] = (str, int)

    def __call__(self, value: str | int) -> int:
        n = parse_size(str(value), self.option)
        if n < 0 or (n == 0 and not self.zero_ok):
            least = "at least 0" if self.zero_ok else "positive"
            raise QuietError(f"{self.option} must be {least}, not {value!r}", ExitCode.USAGE)
        return n


@dataclasses.dataclass(frozen=True)
class Address:
    """``HOST:PORT`` to listen on, where port 0 takes any free one; or, with ``connect``,
    to connect to (port 1 to 65535)."""

    option: str
    connect: bool = False
    toml_types: ClassVar[tuple[type, ...]] = (str,)

    def __call__(self, value: str) -> tuple[str, int]:
        host, port = parse_address(value, self.option)
        if port > 65535:
            raise QuietError(f"{self.option} port must be at most 65535, not {port}",
                             ExitCode.USAGE)
        if self.connect and port == 0:
            raise QuietError(f"{self.option} port must be at least 1, not 0", ExitCode.USAGE)
        return host, port


@dataclasses.dataclass(frozen=True)
class Addresses:
    """``HOST:PORT[,HOST:PORT...]`` to connect to, in order, each checked as ``Address``
    does: comma-separated on the command line, a string or an array of strings in the
    config file. A repeated address counts once."""

    option: str
    toml_types: ClassVar[tuple[type, ...]] = (str, list)

    def __call__(self, value: str | list) -> tuple[tuple[str, int], ...]:
        texts = value.split(",") if isinstance(value, str) else value
        one = Address(self.option, connect=True)
        out = []
        for text in texts:
            if not isinstance(text, str):
                raise QuietError(f"{self.option} must list strings, not {text!r}",
                                 ExitCode.USAGE)
            out.append(one(text.strip()))
        if not out:
            raise QuietError(f"{self.option} must name at least one HOST:PORT",
                             ExitCode.USAGE)
        return tuple(dict.fromkeys(out))


def listen_error(option: str, host: str, port: int, exc: OSError) -> QuietError:
    """The one-line error of a daemon that cannot listen where ``option`` says."""
    return QuietError(f"cannot listen on {host}:{port}: {exc.strerror or exc}: stop what uses "
                      f"it or pick another {option} address", ExitCode.USAGE)


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise QuietError(f"invalid {what} {text!r}: use HOST:PORT", ExitCode.USAGE)
    return host, int(port)
