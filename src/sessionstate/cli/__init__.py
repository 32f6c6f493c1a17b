"""The ``sessionstate`` command line: A/B validation, size tables, and a demo.

Subcommands: ``ab``, ``sizes``, ``plan``, ``rollout``, ``demo``, ``inspect``, ``cluster``,
``serve-bench`` (each with
``--help``), one module each. ``ab``, ``sizes`` and ``plan`` take ``--model``
(``dreamzero``, the default, or ``cosmos3``); each model describes itself to them with a
`sessionstate.models._registry.ModelSpec`. Building the parser imports no torch, so
``--help`` answers at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from sessionstate.cli import _ab, _cluster, _demo, _inspect, _plan, _rollout, _serve, _sizes
from sessionstate.cli._ab import _print_ab as _print_ab  # tests render a report with it
from sessionstate.cli._common import EXTRAS, ArgumentParser, HelpFormatter
from sessionstate.cli._sizes import size_table

__all__ = ["build_parser", "main", "size_table"]

_DESCRIPTION = """\
Check and size the per-session state of the reference world models (DreamZero, Cosmos3):
compare the bespoke and the manager-backed path output for output, and count the bytes
every session holds.

Run `sessionstate COMMAND --help` for a command's options and their defaults.
"""

_SUBCOMMANDS = (_ab, _sizes, _plan, _rollout, _demo, _inspect, _cluster, _serve)


def build_parser() -> ArgumentParser:
    """The argument parser of the ``sessionstate`` command.

    >>> build_parser().parse_args(["ab", "--steps", "3"]).steps
    3
    """
    import argparse

    parser = ArgumentParser(
        prog="sessionstate",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=ArgumentParser,
        metavar="{ab,sizes,plan,rollout,demo,inspect,cluster,serve-bench}",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the version"
    )
    for module in _SUBCOMMANDS:
        module.add_parsers(sub)
    for choice in sub.choices.values():
        choice.formatter_class = HelpFormatter
    return parser


def _version() -> str:
    """The installed distribution's version (the one place it is set is ``pyproject.toml``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sessionstate")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _missing_extra(command: str, exc: ModuleNotFoundError) -> str | None:
    """The one line for a command that needs an optional dependency that is not installed."""
    root = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(root)
    if extra is None:
        return None
    return (
        f"sessionstate {command}: error: `sessionstate {command}` needs {root}, which is not "
        f'installed; install the `{extra}` extra from your clone: pip install -e ".[{extra}]" '
        "(no release is on PyPI yet)."
    )


@contextlib.contextmanager
def _ctrl_c_interrupts() -> Iterator[None]:
    """Within the block, SIGINT raises `KeyboardInterrupt` even if the process started ignoring it.

    A shell script's background job inherits SIGINT ignored (so does a command that
    `timeout -s INT` runs from one), and Python keeps an inherited ignore: the first Ctrl-C
    or `kill -INT` would do nothing. A handler the caller installed is left alone.
    """
    ignored = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    )
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _import_torch_whole()
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _import_torch_whole() -> None:
    """Imports torch with SIGINT held until the import is done, then acts on it.

    A `KeyboardInterrupt` raised inside torch's C++ initialisation aborts the process
    (``terminate called after throwing an instance of 'pybind11::error_already_set'``)
    instead of unwinding; every subcommand imports torch, so it is imported here, whole.
    """
    if "torch" in sys.modules or threading.current_thread() is not threading.main_thread():
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:  # delivered again, now to the handler the import held it from
        signal.raise_signal(signal.SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``sessionstate`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # `_episode` (one side of `ab`) is internal: its own parser, never offered as a choice.
    parser = _ab.episode_parser() if argv[:1] == ["_episode"] else build_parser()
    try:
        args = parser.parse_args(argv[1:] if argv[:1] == ["_episode"] else argv)
    except SystemExit as exc:  # argparse exits on --help and on bad arguments
        return exc.code if isinstance(exc.code, int) else 2
    try:
        with _ctrl_c_interrupts():
            status: int = args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        print(f"sessionstate {args.command}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        line = _missing_extra(args.command, exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"sessionstate {args.command}: error: {message}", file=sys.stderr)
        return 2
    return status
