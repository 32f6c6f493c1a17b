"""What the benchmark modules share: sizes, the two paths, the machine, tiny DreamZero records.

The benchmark modules sit side by side in ``benchmarks/`` and import each other by name (a
script's folder is first on ``sys.path``); `run.py` runs them all.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sessionstate import DEFAULT_MAX_SESSIONS, ENV_ENABLE, LatentBuffer
from sessionstate.models.dreamzero import DreamZeroConfig, new_session
from sessionstate.models.dreamzero.state import DreamZeroSession

# The two session-state paths, and the value of the manager flag that selects each.
PATHS = {"bespoke": "0", "managed": "1"}
MIB = 1024 * 1024


def path_environ(path: str, **extra: str) -> dict[str, str]:
    """The environment that selects ``path`` (``bespoke`` or ``managed``), plus ``extra``."""
    return {ENV_ENABLE: PATHS[path], **extra}


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is; ``quick`` shrinks every one to a smoke run."""

    steps: int
    step_repeats: int
    step_window: int
    step_checkpoints: tuple[int, ...]
    step_warmup: int
    reader_frames: tuple[int, ...]
    overhead_chunks: tuple[int, ...]
    accumulate_chunks: tuple[int, ...]
    # How pyperf runs the micro-benchmarks (`micro.py`): its own command-line options.
    pyperf_args: tuple[str, ...]
    stats_sessions: tuple[int, ...]
    stats_video_chunks: int
    memory_steps: int
    memory_samples: tuple[int, ...]
    memory_deploy_steps: int


FULL = Sizes(
    steps=400,
    step_repeats=7,
    step_window=32,
    step_checkpoints=(10, 100, 400),
    step_warmup=8,
    reader_frames=(10, 100, 400),
    overhead_chunks=(10, 400),
    accumulate_chunks=(10, 400, 4000),
    pyperf_args=(
        "--processes",
        "4",
        "--values",
        "5",
        "--warmups",
        "1",
        "--min-time",
        "0.05",
        "--inherit-environ",
        "PYTHONPATH",
    ),
    stats_sessions=(1, 8, DEFAULT_MAX_SESSIONS, 256),
    stats_video_chunks=8,
    memory_steps=400,
    memory_samples=(1, 10, 50, 100, 200, 300, 400),
    memory_deploy_steps=400,
)

QUICK = Sizes(
    steps=12,
    step_repeats=1,
    step_window=4,
    step_checkpoints=(4, 8, 12),
    step_warmup=1,
    reader_frames=(2, 4, 8),
    overhead_chunks=(2, 8),
    accumulate_chunks=(10, 40),
    # One process, one value of one loop: a smoke run, seconds.
    pyperf_args=("--in-process", "--debug-single-value"),
    stats_sessions=(1, 8, DEFAULT_MAX_SESSIONS, 256),
    stats_video_chunks=8,
    memory_steps=6,
    memory_samples=(1, 3, 6),
    memory_deploy_steps=2,
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def code_version() -> dict[str, Any]:
    """The commit the measured code is at, whether the tree had changes, and the UTC time."""
    import datetime
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", "src")),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_info() -> dict[str, Any]:
    """The machine and runtime a run was measured on, and the code's commit and the date."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": list(os.getloadavg()),
        **code_version(),
    }


FEAT_MAP_SLOTS = 26
FEAT_MAP_TENSORS = 24


def tiny_feat_map() -> tuple[torch.Tensor | None, ...]:
    """A Wan-encoder-shaped causal-conv cache (24 tensors in 26 slots) of tiny tensors."""
    tensors = tuple(torch.zeros(1, 2, 2, 2, 2) for _ in range(FEAT_MAP_TENSORS))
    return tensors + (None,) * (FEAT_MAP_SLOTS - FEAT_MAP_TENSORS)


def tiny_session(
    cfg: DreamZeroConfig,
    *,
    video_chunks: int,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DreamZeroSession:
    """A mid-window DreamZero session record: every value set, tiny tensors.

    ``shared`` is ``(language, prompt_embeds)`` to alias with other sessions of one prompt.
    """
    state = new_session(cfg)
    for _ in range(4):
        state = state.update_object(
            "stitched_buffer", commit(torch.zeros(4, 4, 3, dtype=torch.uint8))
        )
    for _ in range(cfg.num_frame_per_block):
        state = state.update_object("vae_encoder_out", commit(torch.zeros(1, 4, 1, 2, 2)))
    for _ in range(video_chunks):
        state = state.update_object("video_latents_across_time", commit(torch.zeros(1, 2, 2, 2, 2)))
    language, prompt_embeds = shared or (torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, 2))
    state = state.update_object("vae_enc_feat_map", lambda c: c.commit(tiny_feat_map()))
    out = state.with_attrs(
        call_count=5,
        current_start_frame=9,
        clip_feas=torch.zeros(1, 5, 2),
        ys=torch.zeros(1, 8, 3, 2, 2),
        language=language,
        prompt_embeds=prompt_embeds,
        vae_stream_initialized=True,
        vae_pending_body_frames=torch.zeros(1, 3, 2, 4, 4),
    )
    assert isinstance(out, DreamZeroSession)
    return out


def commit(chunk: torch.Tensor) -> Callable[[LatentBuffer], LatentBuffer]:
    """A transition that commits ``chunk`` to a buffer, for `SessionState.update_object`."""
    return lambda buffer: buffer.commit(chunk)
