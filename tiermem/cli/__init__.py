"""The ``tiermem`` command: ``bench`` (how fast each tier moves bytes), ``plan`` (how many bytes each
tensor class needs, per policy and tier) and ``info`` (what this machine offers).

Errors a user can cause print one ``tiermem: ...`` line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn, Optional, Sequence

from tiermem import __version__
from tiermem.errors import TierMemError

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that says where to look, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"tiermem: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    from tiermem.cli import bench, info, plan  # the subcommands add their own options

    parser = _Parser(
        prog="tiermem",
        description="Tiered memory for PyTorch training: measure this "
        "machine's tiers, plan where a model's bytes go, and check the setup.",
    )
    parser.add_argument("--version", action="version", version=f"tiermem {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what tiermem does (to stderr)")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    bench.add_parser(sub)
    plan.add_parser(sub)
    info.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``tiermem`` console script and of ``python -m tiermem``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return USAGE_ERROR
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.run(args))
    except TierMemError as e:
        print(str(e).splitlines()[0] if str(e) else "tiermem: failed", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("tiermem: interrupted", file=sys.stderr)
        return 130


__all__ = ["main", "build_parser"]
