"""DreamZero's managed tiny step on CPU per dtype, as a ratio of the float32 step, in one run.

Three pipelines step the same observations in turns (the order rotates every round, so a
change in machine load hits all alike): float32; bfloat16 with its convolutions run in
float32 and rounded once (what the model does on CPU); and bfloat16 with torch's own
reduced-precision convolutions (what it did before, kept here as the comparison). Each is
timed with `time.process_time` (one intra-op thread), and the medians are reported as ratios
of float32's.

oneDNN takes a bfloat16 convolution only on CPUs with AVX-512 or AMX; elsewhere torch runs its
slow reference kernel. To see such a CPU on one that has them, limit the ISAs first:

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/dtypes.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import attrs
import torch

from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode

MANAGED = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}


def _pipeline(dtype: str, *, native_convs: bool = False) -> DreamZeroPipeline:
    cfg = attrs.evolve(DreamZeroConfig.preset("tiny"), dtype=dtype)
    pipe = DreamZeroPipeline(cfg, environ=MANAGED)
    if native_convs:  # the module's own `_conv_forward` again (a class attribute)
        nets = pipe.nets
        for module in (nets.vae, nets.text_encoder, nets.image_encoder, nets.denoiser):
            for conv in module.modules():
                conv.__dict__.pop("_conv_forward", None)
    return pipe


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3, help="episodes per variant")
    parser.add_argument("--steps", type=int, default=6, help="steps per episode")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    variants = {
        "float32": lambda: _pipeline("float32"),
        "bfloat16": lambda: _pipeline("bfloat16"),
        "bfloat16, torch's own convolutions": lambda: _pipeline("bfloat16", native_convs=True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            pipe = variants[name]()
            cfg = pipe.cfg
            episode = list(scripted_episode(cfg, steps=args.steps, sessions=1, seed=r))
            start = time.process_time()
            for sid, obs in episode:
                pipe.forward(obs, sid)
            times[name].append((time.process_time() - start) / args.steps)
    base = statistics.median(times["float32"])
    report = {
        name: {
            "median_step_s": statistics.median(ts),
            "ratio_to_float32": statistics.median(ts) / base,
        }
        for name, ts in times.items()
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
