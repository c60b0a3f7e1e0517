"""The ``mqttring`` command: one subcommand per operator task.

Each subcommand lives next to the code it drives and exposes ``register(subparsers)``, which
adds its parser and sets ``func`` (a callable taking the parsed args and returning an exit
code).  Adding a command is one line in ``SUBCOMMANDS``; this module stays a dispatcher.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from mqttring import __version__
from mqttring.stop_signals import hold

#: Modules that provide ``register(subparsers)``.
SUBCOMMANDS: tuple[str, ...] = ("mqttring.node", "mqttring.raft.admin", "mqttring.certs",
                                "mqttring.analytics.cli", "mqttring.spark.cli",
                                "mqttring.security.passwd_cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mqttring", description="mqttring: a distributed MQTT 3.1.1 and 5.0 broker."
    )
    parser.add_argument("--version", action="version", version=f"mqttring {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; its exit code.  A ``ConfigError`` a subcommand did not turn into
    its own message (a bad ``--node`` address, say) is one ``error:`` line and exit 2, not
    a traceback: it is the operator's input, never a bug to report.

    Stop signals are held while the subcommands are imported (a second): for ``mqttring
    node`` they are the node's to act on (``mqttring.stop_signals``); any other command gets
    its usual handlers back, and what came meanwhile, before it runs.
    """
    held = hold()
    try:
        args = build_parser().parse_args(argv)
    except BaseException:  # --help, a usage error: SystemExit
        held.release()
        raise
    if not getattr(args, "holds_signals", False):
        held.release()
    from mqttring.config import ConfigError  # after the hold: it imports the broker's config

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Its reader went away (``mqttring status | head``): nothing left to say.  Python's
        # own flush of stdout at exit would raise again, so stdout points nowhere now.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
