"""The ``chronomq`` command."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chronomq", description="chronomq delayed-delivery message broker")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_subparsers(dest="command")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version or not args.command:
        from chronomq import __version__

        print(f"chronomq {__version__}")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
