"""Command line: ``python -m aner_nb demo`` (the main job)."""

from __future__ import annotations

import sys

COMMANDS = ("demo",)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: python -m aner_nb {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from .demo import main as demo_main

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
