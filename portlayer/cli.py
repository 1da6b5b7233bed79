"""The ``portlayer`` command line: one subcommand per user task.

User errors (a missing model, a bad descriptor, a tampered artifact: any
``portlayer.errors.PortlayerError``) print one clear message and exit with status 2; a
closed pipe (``portlayer inspect M | head -1``) ends quietly; anything else is a bug in
portlayer and keeps its traceback, followed by a line asking for a report.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from portlayer.errors import ISSUES_URL, UsageError, is_user_error

#: modules contributing subcommands through ``add_parsers(subparsers)``
SUBCOMMAND_MODULES = (
    "portlayer.cli_inspect",
    "portlayer.cli_capabilities",
    "portlayer.cli_compile",
    "portlayer.cli_run",
    "portlayer.cli_serve",
    "portlayer.cli_tune",
)

#: exit status of a process killed by SIGPIPE, as shells report it (what `cat` gives under `| head`)
EXIT_BROKEN_PIPE = 141

UserError = UsageError  # the old name


def build_parser() -> argparse.ArgumentParser:
    from portlayer import __version__

    parser = argparse.ArgumentParser(
        prog="portlayer",
        description="Compile Hugging Face models for the accelerator you have, and run them.",
    )
    parser.add_argument("--version", action="version", version=f"portlayer {__version__}")
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
    _describe(sub)
    return parser


def _describe(sub: argparse._SubParsersAction) -> None:
    """Every verb's --help opens with a description: its own, else its one-line help."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, p in sub.choices.items():
        if not p.description and helps.get(name):
            p.description = helps[name][0].upper() + helps[name][1:] + "."
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for n in nested:
            _describe(n)


def main(argv: Sequence[str] | None = None) -> int:
    if "--interpret" in (sys.argv[1:] if argv is None else argv):
        # Triton fixes interpreted-or-compiled when it is first imported: decide before anything imports it.
        os.environ["TRITON_INTERPRET"] = "1"
    args = None
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a pipe closed by the reader fails here, inside the handler, not at exit
        return rc
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as e:
        command = f"portlayer {args.command}" if getattr(args, "command", None) else "portlayer"
        if is_user_error(e):
            _print_err(f"{command}: error: {_message(e)}")
            return 2
        traceback.print_exc()
        _print_err(f"{command}: internal error ({type(e).__name__}); this is a bug in portlayer, "
                   f"please report it with the traceback above: {ISSUES_URL}")
        return 1


def _message(e: BaseException) -> str:
    return str(e) or type(e).__name__


def _print_err(text: str) -> None:
    try:
        print(text, file=sys.stderr)
    except (BrokenPipeError, ValueError):
        pass


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
