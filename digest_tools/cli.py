"""The ``quiver digest`` subcommands."""
from __future__ import annotations

import argparse
import json
import sys

from digest_tools.hashing import default_workers
from quiverfs import digest as digest_format
from quiverfs.dataset_name import check_name
from quiverfs.digest_checks import MAX_LABEL_LEVEL
from quiverfs.errors import ExitCode
from quiverfs.option_types import IntAtLeast
from quiverfs.sizes import human
from quiverfs.storage_cli import add_storage_options, storage_options


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("digest", help="create, inspect, verify and compare dataset digests",
                       description="A digest lists each item's SHA-256, size, path, label and "
                       "storage location. Holding it is the right to read the content from "
                       "the cache.")
    dsub = p.add_subparsers(dest="digest_command", metavar="ACTION", required=True)

    c = dsub.add_parser("create", help="hash every item under SRC and write a digest",
                        description="Walk SRC (a directory, file:///DIR or gs://BUCKET/PREFIX), "
                        "hash every file in parallel and write a digest. Labels are the "
                        "directory LABEL_LEVEL levels under SRC (1: the ImageFolder class).")
    c.add_argument("src", help="dataset root: a directory, file:///DIR or gs://BUCKET[/PREFIX]")
    c.add_argument("-o", "--output", required=True, help="digest file to write")
    c.add_argument("--name", type=check_name,
                   help="dataset name (default: the last component of SRC)")
    c.add_argument("--workers", type=IntAtLeast("--workers", 1), default=default_workers(),
                   help="parallel readers/hashers (default: %(default)s)")
    c.add_argument("--label-level", default=1,
                   type=IntAtLeast("--label-level", 0, MAX_LABEL_LEVEL),
                   help="which directory level names the label (default: 1, the first "
                   "directory under SRC; use 2 for SRC/train/CLASS/file)")
    add_storage_options(c)
    c.set_defaults(func=cmd_create)

    s = dsub.add_parser("show", help="print a digest's summary (or its entries)")
    s.add_argument("file", help="digest file")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--entries", action="store_true", help="include every entry")
    s.set_defaults(func=cmd_show)

    v = dsub.add_parser("verify", help="re-read the sources and check every hash",
                        description="Exit 0 when every item matches, 1 listing each missing, "
                        "unreadable or changed item.")
    v.add_argument("file", help="digest file")
    v.add_argument("--workers", type=IntAtLeast("--workers", 1), default=default_workers(),
                   help="parallel readers (default: %(default)s)")
    add_storage_options(v)
    v.set_defaults(func=cmd_verify)

    d = dsub.add_parser("diff", help="compare two digests by path and content",
                        description="Exit 0 when A and B list the same paths with the same "
                        "content, 1 otherwise.")
    d.add_argument("a", help="first digest")
    d.add_argument("b", help="second digest")
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(func=cmd_diff)


def cmd_create(args: argparse.Namespace) -> int:
    from digest_tools.create import create_digest

    data = create_digest(args.src, args.name, args.workers, args.label_level,
                         storage_options(args))
    digest_format.write_atomic(args.output, data)
    d = digest_format.decode(data)
    print(f"{args.output}: {len(d)} items, {human(d.total_bytes)}, "
          f"{len([x for x in d.labels if x])} labels, identity {d.identity[:16]}")
    return ExitCode.OK


def cmd_show(args: argparse.Namespace) -> int:
    d = digest_format.load(args.file)
    info = d.summary()
    if args.entries:
        info["entries"] = [e.as_dict() for e in d.entries()]
    if args.json:
        json.dump(info, sys.stdout, indent=None if args.entries else 2)
        print()
        return ExitCode.OK
    print(f"name:     {d.name}\nsource:   {d.source}\nitems:    {len(d)}\n"
          f"bytes:    {d.total_bytes} ({human(d.total_bytes)})\nlabels:   {info['labels']}\n"
          f"identity: {d.identity}")
    if args.entries:
        for e in d.entries():
            print(f"{e.hash}  {e.size:>10}  {e.label or '-':<16} {e.path}")
    return ExitCode.OK


def cmd_verify(args: argparse.Namespace) -> int:
    from digest_tools.verify import verify_digest

    d = digest_format.load(args.file)
    problems = verify_digest(d, args.workers, storage_options(args))
    for p in problems:
        print(f"{p.kind}: {p.path}: {p.detail}")
    if problems:
        print(f"{len(problems)} of {len(d)} items do not match {args.file}", file=sys.stderr)
        return ExitCode.MISMATCH
    print(f"all {len(d)} items match")
    return ExitCode.OK


def cmd_diff(args: argparse.Namespace) -> int:
    from digest_tools.diff import diff_digests

    r = diff_digests(digest_format.load(args.a), digest_format.load(args.b))
    if args.json:
        json.dump({"only_a": r.only_a, "only_b": r.only_b, "changed": r.changed,
                   "shared_content": r.shared_content, "identical": r.identical}, sys.stdout)
        print()
    else:
        for p in r.only_a:
            print(f"- {p}")
        for p in r.only_b:
            print(f"+ {p}")
        for p in r.changed:
            print(f"~ {p}")
        print(f"{len(r.only_a)} removed, {len(r.only_b)} added, {len(r.changed)} changed, "
              f"{r.shared_content} distinct contents shared")
    return ExitCode.OK if r.identical else ExitCode.MISMATCH
