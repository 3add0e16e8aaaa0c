"""The `tensorwatch-otel` command line: one subcommand per module, loaded only when chosen."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Dict, List, Optional, Sequence, Set

from .._version import __version__

# name -> module exposing HELP (one line), add_arguments(parser) and run(args) -> exit code
COMMANDS = {
    "demo": "tensorwatch_otel.cli.demo",
    "report": "tensorwatch_otel.cli.report",
    "diff": "tensorwatch_otel.cli.diff",
    "nettest": "tensorwatch_otel.diagnostics.nettest",
    "doctor": "tensorwatch_otel.diagnostics.doctor",
}


EXIT_USAGE = 2  # bad input: an argument, a file or an environment variable the command cannot use


def usage_error(command: str, message: str) -> int:
    """Says `tensorwatch-otel COMMAND: error: MESSAGE` on stderr, the one form every command
    uses for bad input, and returns EXIT_USAGE."""
    print(f"tensorwatch-otel {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def events_per_batch(events: Sequence[Any]) -> str:
    """`B (kind, kind); B (kind)`: the kinds of event each batch of a log holds (said when a
    selection matched nothing)."""
    seen: Dict[int, Set[str]] = {}
    for e in events:
        seen.setdefault(e.batch_number, set()).add(e.event)
    return "; ".join(f"{b} ({', '.join(sorted(kinds))})" for b, kinds in sorted(seen.items()))


class _Parser(argparse.ArgumentParser):
    """argparse with usage_error()'s one line instead of a usage block on bad arguments."""

    def error(self, message: str):  # type: ignore[override]
        command = self.prog.split(" ", 1)[1] if " " in self.prog else "COMMAND"
        sys.exit(usage_error(command, f"{message} (see tensorwatch-otel {command} --help)"
                             if command != "COMMAND" else f"{message} (see tensorwatch-otel --help)"))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tensorwatch-otel",
        description="Find the first inf/nan in PyTorch training, export per-module tensor "
        "statistics to Prometheus/OpenTelemetry, and check the cluster it runs on.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, modname in COMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ImportError:  # a command still being built is simply absent
            continue
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
