"""The ``portlayer`` command line: one subcommand per user task.

User errors (a missing model, a bad descriptor, a tampered artifact) print one clear
message and exit with status 2; a traceback means a bug in portlayer.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: modules contributing subcommands through ``add_parsers(subparsers)``
SUBCOMMAND_MODULES = (
    "portlayer.cli_inspect",
    "portlayer.cli_capabilities",
    "portlayer.cli_compile",
    "portlayer.cli_run",
)


class UserError(Exception):
    """An error caused by input the user can fix; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="portlayer",
        description="Compile Hugging Face models for the accelerator you have, and run them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod_name in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name == mod_name:
                continue
            raise
        mod.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if "--interpret" in (sys.argv[1:] if argv is None else argv):
        import os

        # Triton fixes interpreted-or-compiled when it is first imported: decide before anything imports it.
        os.environ["TRITON_INTERPRET"] = "1"
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # user-facing errors carry their own clear message
        if _is_user_error(e):
            print(f"portlayer {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise
    return int(rc or 0)


def _is_user_error(e: Exception) -> bool:
    from portlayer.errors import USER_ERRORS

    return isinstance(e, USER_ERRORS)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
