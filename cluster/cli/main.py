"""`splitserve` command line: make-model, generate, serve, calibrate-route, plan, drain-node, and the commands other packages
register under the `splitserve.commands` entry point group (bench/ registers `bench` in
pyproject.toml), so the cluster never imports a layer above it."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

# Entry point group of extra subcommands: each names a function that takes the subparsers
# action and adds its own parser (with `func` set), like add_serve_parser does.
COMMAND_GROUP = "splitserve.commands"


def add_registered_parsers(subparsers: argparse._SubParsersAction) -> None:
    for entry_point in sorted(entry_points(group=COMMAND_GROUP), key=lambda point: point.name):
        entry_point.load()(subparsers)


def build_parser() -> argparse.ArgumentParser:
    from splitserve.cluster.cli.calibrate_route import add_calibrate_route_parser
    from splitserve.cluster.cli.drain_node import add_drain_node_parser
    from splitserve.cluster.cli.generate import add_generate_parser
    from splitserve.cluster.cli.plan import add_plan_parser
    from splitserve.cluster.cli.serve import add_serve_parser
    from splitserve.engine.builtin_models.make_model import add_make_model_parser

    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Disaggregated prefill/decode LLM serving on Ray.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_make_model_parser(subparsers)
    add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    add_calibrate_route_parser(subparsers)
    add_plan_parser(subparsers)
    add_drain_node_parser(subparsers)
    add_registered_parsers(subparsers)
    parser.set_defaults(command_parsers=subparsers.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report it with the usage of the command it was given to, not splitserve's
        command_parser = args.command_parsers.get(args.command, parser)
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handling
        print(f"splitserve {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
