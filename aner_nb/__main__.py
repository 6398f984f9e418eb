"""Command line: ``python -m aner_nb report`` (the main job), ``demo``, ``serve`` and ``lab``."""

from __future__ import annotations

import sys

COMMANDS = ("report", "demo", "serve", "lab")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: python -m aner_nb {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        print("  report  execute notebooks/01_quickstart.ipynb headless; write reports/01_quickstart.html", file=sys.stderr)
        print("  demo    load the demo model, stream one answer, print timings and memory", file=sys.stderr)
        print("  serve   serve a GGUF model over HTTP (aner-nb serve MODEL.gguf -h)", file=sys.stderr)
        print("  lab     open the tutorials in JupyterLab with this Python's kernel (the lab extra)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "report":
        from .report import main as report_main

        return report_main(argv[1:])
    if argv[0] == "lab":
        from .lab import main as lab_main

        return lab_main(argv[1:])
    if argv[0] == "serve":
        from .api.cli import main as serve_main

        return serve_main(argv[1:])
    from .demo import main as demo_main

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
