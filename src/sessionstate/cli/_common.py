"""What the subcommands share: the parser class, argument types, config loading, byte format.

Nothing here imports torch: ``sessionstate --help`` builds every parser and must stay light.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from sessionstate.models._registry import DEFAULT_MODEL, get_model

MIB = 1024 * 1024

# The pip extra that brings each optional dependency a subcommand may import.
EXTRAS = {"diffusers": "models", "rich": "models", "ray": "ray", "hypothesis": "testing"}


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and name the help to read.

    An unrecognised option is reported by the subcommand it was given to, with the closest
    option it has; a negative value after an option that takes one (``--device-bytes
    -5GiB``) is that option's value, for its type to refuse, not an unknown flag. Options
    are recorded as `add_argument` adds them (argument groups are not used here).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.options: list[str] = []
        self.valued_options: set[str] = set()  # the options followed by one value
        self.commands: dict[str, ArgumentParser] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.options += action.option_strings
        if action.option_strings and action.nargs is None:
            self.valued_options.update(action.option_strings)
        return action

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self.commands = action.choices
        return action

    def parse_known_args(  # type: ignore[override]  # typeshed's overloads: one form is used
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        return super().parse_known_args(self._negative_values_joined(args), namespace)

    def parse_args(  # type: ignore[override]  # typeshed's overloads: one form is used
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self.commands.get(getattr(parsed, "command", None) or "", self)
            owner.error(owner.unrecognized(extras))
        return parsed

    def unrecognized(self, extras: Sequence[str]) -> str:
        """The message for arguments this parser does not know, with the closest option."""
        import difflib

        message = f"unrecognized arguments: {' '.join(extras)}"
        for arg in extras:
            if arg.startswith("--"):
                close = difflib.get_close_matches(arg.partition("=")[0], self.options, n=1)
                if close:
                    return f"{message}; did you mean `{close[0]}`?"
        return message

    def error(self, message: str) -> NoReturn:
        # One line, no usage dump: `sessionstate ab: error: ...`.
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _negative_values_joined(self, args: Sequence[str] | None) -> list[str]:
        """``--opt -5GiB`` as ``--opt=-5GiB``: argparse would take ``-5GiB`` for a flag."""
        given = list(sys.argv[1:] if args is None else args)
        out: list[str] = []
        i = 0
        while i < len(given):
            arg = given[i]
            if arg == "--":
                return out + given[i:]
            following = given[i + 1] if i + 1 < len(given) else ""
            if arg in self.valued_options and re.match(r"-\.?\d", following):
                out.append(f"{arg}={following}")
                i += 2
            else:
                out.append(arg)
                i += 1
        return out


def negative_size(text: str, *, example: str) -> str | None:
    """The message for a negative byte count, or None if ``text`` is not one.

    >>> negative_size("-5GiB", example="80GiB")
    "a size cannot be negative, got '-5GiB'; pass one such as 80GiB"
    """
    if not text.strip().startswith("-"):
        return None
    return f"a size cannot be negative, got {text!r}; pass one such as {example}"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, unless it has none or the help names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """Parses a positive int argument.

    >>> positive_int("3")
    3
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def nbytes(text: str) -> int:
    """Parses a positive byte count such as ``1048576`` or ``24GiB``.

    >>> nbytes("2MiB")
    2097152
    """
    from sessionstate._manager import parse_nbytes

    negative = negative_size(text, example="24GiB")
    if negative is not None:
        raise argparse.ArgumentTypeError(negative)
    try:
        value = parse_nbytes(text, name="--max-bytes")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 1048576 or 24GiB, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {text!r}")
    return value


def budget(text: str) -> int | dict[str, int]:
    """Parses ``--max-bytes``: a positive byte count, or ``device=count`` pairs.

    The text a byte budget takes everywhere (`SessionStateManager`'s ``max_bytes``, the
    deploy config, ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES``): one reading, one
    message (`BudgetTextError`'s).

    >>> budget("2MiB"), budget("cpu=2MiB")
    (2097152, {'cpu': 2097152})
    """
    from sessionstate._manager import BudgetTextError, parse_budget_text

    negative = negative_size(text, example="24GiB")
    if negative is not None:
        raise argparse.ArgumentTypeError(negative)
    try:
        return parse_budget_text(text, positive=True)
    except BudgetTextError as error:
        raise argparse.ArgumentTypeError(str(error).rstrip(".")) from None


def budget_text(value: int | dict[str, int]) -> str:
    """The ``--max-bytes`` text of a parsed budget (what `budget` reads back as ``value``).

    >>> budget_text(2097152), budget_text({"cpu": 1024, "meta": 2})
    ('2097152', 'cpu=1024,meta=2')
    """
    if isinstance(value, dict):
        return ",".join(f"{device}={count}" for device, count in value.items())
    return str(value)


PIPED_WIDTH = 1000
"""The width a command's console takes when stdout is not a terminal (wider than any table)."""


def stdout_console() -> Any:
    """The rich console a command prints its tables on.

    On a terminal, the terminal's width. Piped or redirected there is no width to fit, and
    rich's default of 80 columns cut a wide table's headers ("sessio…"); the console is then
    `PIPED_WIDTH` wide, so every header and cell prints whole (a table takes only the width
    its content needs), without colour.

    >>> import io, contextlib
    >>> with contextlib.redirect_stdout(io.StringIO()):
    ...     console = stdout_console()
    >>> console.width
    1000
    """
    from rich.console import Console

    console = Console()
    if console.is_terminal:
        return console
    return Console(width=PIPED_WIDTH)


def check_device(text: str) -> None:
    """Raises `ValueError` with one line of fix unless ``text`` names a device this torch can use.

    >>> check_device("cpu")
    >>> check_device("banana")
    Traceback (most recent call last):
    ...
    ValueError: `--device` must name a torch device such as cpu, cuda or cuda:1, got 'banana'.
    """
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        msg = f"`--device` must name a torch device such as cpu, cuda or cuda:1, got {text!r}."
        raise ValueError(msg) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build"
            msg = (
                f"`--device {text}` needs a CUDA GPU, but torch {torch.__version__} is "
                f"{build} and sees none; pass `--device cpu`, or run on a machine with a GPU "
                "and a CUDA build of torch."
            )
            raise ValueError(msg)
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            msg = (
                f"`--device {text}` names GPU {device.index}, but torch sees {count} "
                f"(cuda:0 to cuda:{count - 1}); pass one of those."
            )
            raise ValueError(msg)
    elif device.type not in ("cpu", "meta"):
        msg = f"`--device {text}` is not supported here; pass cpu or cuda[:N]."
        raise ValueError(msg)


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--device``, ``--max-bytes`` and ``--park-tier`` to ``parser``."""
    parser.add_argument(
        "--device", default="cpu", help="where the networks and session tensors live"
    )
    parser.add_argument(
        "--max-bytes",
        type=budget,
        help="the managed path's byte budget: a count for --device (e.g. 24GiB), or "
        "device=count pairs as the environment variable takes them (e.g. cpu=2MiB or "
        "cuda:0=24GiB,cpu=8GiB); least recently used sessions are parked to stay under it",
    )
    parser.add_argument(
        "--park-tier",
        choices=["host", "disk"],
        help="where the budget parks state (default: host for a CUDA device, else disk)",
    )


def with_budget(deploy: Any, args: argparse.Namespace) -> Any:
    """The deploy config with ``--max-bytes`` and the park tier applied (if given)."""
    import attrs

    if getattr(args, "max_bytes", None) is None:
        return deploy
    tier = args.park_tier or ("host" if str(args.device).startswith("cuda") else "disk")
    return attrs.evolve(
        deploy, session_state_max_bytes=args.max_bytes, session_state_park_tier=tier
    )


def load_model_config(
    config: str | None,
    preset: str | None,
    model_name: str = DEFAULT_MODEL,
    overrides: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """The deploy config (its ``model`` section completed) and the model's config.

    ``overrides`` are model fields set over the config's (a flag such as ``--decode-frames``).
    """
    import attrs

    from sessionstate import OmniDiffusionConfig

    deploy = OmniDiffusionConfig.from_yaml(config) if config else OmniDiffusionConfig()
    model = dict(deploy.model)
    if preset is not None:
        model["preset"] = preset
    model.update(overrides or {})
    model.setdefault("preset", "tiny")
    return attrs.evolve(deploy, model=model), get_model(model_name).config_from_dict(model)


_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def fmt_bytes(n: float, *, zero: str = "0 B") -> str:
    """A byte count as every table and message of the command prints it.

    Two decimals in the largest binary unit the count fills; ``zero`` stands for 0 (a
    table shows ``"-"`` for a value a path does not hold).

    >>> fmt_bytes(0), fmt_bytes(0, zero="-"), fmt_bytes(512), fmt_bytes(18432)
    ('0 B', '-', '512 B', '18.00 KiB')
    >>> fmt_bytes(6 * 2**30), fmt_bytes(6_487_998_464)
    ('6.00 GiB', '6.04 GiB')
    """
    if n == 0:
        return zero
    for unit, size in _BINARY_UNITS:
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_at_least(n: int) -> str:
    """A byte count rounded up to `fmt_bytes`' precision, as an argument to pass: no smaller.

    >>> fmt_at_least(6_487_998_464), fmt_at_least(512)
    ('6.05GiB', '512B')
    """
    for unit, size in _BINARY_UNITS:
        if n >= size:
            return f"{math.ceil(n * 100 / size) / 100:.2f}{unit}"
    return f"{n}B"
