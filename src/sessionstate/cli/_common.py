"""What the subcommands share: the parser class, argument types, config loading, byte format.

Nothing here imports torch: ``sessionstate --help`` builds every parser and must stay light.
"""

from __future__ import annotations

import argparse
from typing import Any

from sessionstate.models._registry import DEFAULT_MODEL, get_model

MIB = 1024 * 1024

# The pip extra that brings each optional dependency a subcommand may import.
EXTRAS = {"diffusers": "models", "rich": "models", "ray": "ray", "hypothesis": "testing"}


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, without the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, no usage dump: `sessionstate ab: error: ...`.
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


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

    try:
        value = parse_nbytes(text, name="--max-bytes")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 1048576 or 24GiB, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {text!r}")
    return value


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
        type=nbytes,
        help="the managed path's byte budget on --device (e.g. 24GiB); least recently used "
        "sessions are parked to stay under it",
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


def fmt_bytes(n: int) -> str:
    """A byte count for a table cell.

    >>> fmt_bytes(0), fmt_bytes(512), fmt_bytes(3 * MIB)
    ('-', '512 B', '3.0000 MiB')
    """
    if n == 0:
        return "-"
    if n < 10 * 1024:
        return f"{n} B"
    return f"{n / MIB:.4f} MiB"
