"""The one rule for dataset names, wherever a name enters: ``digest create --name``,
``quiver mount`` (client side) and mountd's control requests.

A name becomes a directory under the mount root and part of a file name in mountd's
state directory, so it is one safe path component: no ``/``, no leading dot, no
newline or other control character, nothing a shell or a log line would misread.
"""
from __future__ import annotations

import re

from quiverfs.errors import ExitCode, QuietError

MAX_NAME = 128  # characters
NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._+-]{{0,{MAX_NAME - 1}}}")  # use fullmatch


def check_name(name: object) -> str:
    """``name`` if it is a valid dataset name, else QuietError (USAGE); usable as an
    argparse ``type=``."""
    if not isinstance(name, str):
        raise QuietError(f"the dataset name must be a string, not {type(name).__name__}",
                         ExitCode.USAGE)
    if not NAME_RE.fullmatch(name):
        raise QuietError(f"invalid dataset name {name!r}: use letters, digits, '.', '_', '+' "
                         f"or '-', starting with a letter or digit (at most {MAX_NAME})",
                         ExitCode.USAGE)
    return name
