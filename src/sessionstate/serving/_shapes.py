"""Deploy shapes for the simulated clock, every assumed figure stated with its source.

Sizes come from upstream's published figures (LingBot), from our own size table run on the
meta device (DreamZero: `dreamzero_shape` takes `sessionstate plan`'s output, so the plan and
the harness read the same bytes), or are declared where nothing is published (Sana-WM). Step
times are not published for any of them at a multi-session deadline: they are stated
assumptions (``figures``), and every one is an argument of `DeployShape` to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sessionstate.serving._load import GIB, DeployShape

__all__ = ["H200_NBYTES", "LINGBOT", "SANA_WM", "dreamzero_shape"]

MIB = 1024**2
H200_NBYTES = 141 * 10**9
"""An H200's memory (141 GB)."""
A100_NBYTES = 80 * 10**9
"""An A100 80 GB's memory."""
LINK = 50e9
"""Host-device copies on an H200-class machine, pinned memory, each way (vLLM's CPU offloading
reports this order)."""

_WHAT_IF_STEP = (
    "0.1 s per session step is a what-if, assumed: no published figure serves several sessions "
    "of this size on one GPU. Upstream measured LingBot at about 5 FPS on one H200 (2.4 s per "
    "12-frame chunk), under which no policy sustains even one session at a 0.75 s deadline "
    "(the harness refuses that shape: a step longer than the period)."
)

LINGBOT = DeployShape(
    name="lingbot",
    objects={
        "self_attn_kv": round(21.42 * GIB),
        "cross_attn_kv": round(0.39 * GIB),
        "decode_state": 1801 * MIB,
    },
    reserved_nbytes=28 * GIB,
    device_nbytes=H200_NBYTES,
    host_nbytes=1024 * GIB,
    bandwidth=LINK,
    step_s=(0.1,),
    chunk_period_s=0.75,
    ttfc_s=1.5,
    figures={
        "sizes": "self-attention KV 21.42 GiB, cross-attention KV 0.39 GiB (upstream), streaming "
        "decode state 1,801 MiB (#6533)",
        "reserved_nbytes": "28 GiB, assumed: a 14B-parameter DiT in bf16; with it the weights and "
        "two sessions take 75.2 GiB, upstream's '75 GB' that does not fit an 80 GB card (#6227)",
        "chunk_period_s": "0.75 s: 12 frames at 16 FPS (#6534)",
        "ttfc_s": "1.5 s, assumed: two chunk periods for the opening chunk",
        "step_s": _WHAT_IF_STEP,
        "bandwidth": "50 GB/s each way (an H200-class link, pinned memory)",
        "host_nbytes": "1 TiB of host memory for parked sessions, assumed",
    },
)
"""A LingBot-shaped session on an H200 (see ``figures`` for every assumption)."""

SANA_WM = DeployShape(
    name="sana-wm",
    objects={"kv_window": 6 * GIB // 4, "conv_gdn_state": round(0.05 * GIB)},
    reserved_nbytes=12 * GIB,
    device_nbytes=A100_NBYTES,
    host_nbytes=512 * GIB,
    bandwidth=25e9,
    step_s=(0.005,),
    chunk_period_s=1.0,
    ttfc_s=2.0,
    figures={
        "setting": "RFC #4480: one A100 80 GB, paged KV, a KV window of 6 chunks, Poisson "
        "arrivals, geometric lengths; at least 42 concurrent sessions measured",
        "kv_window": "6 chunks x 0.25 GiB, assumed: the RFC publishes no per-session size",
        "conv_gdn_state": "0.05 GiB, assumed (the RFC: conv-buffer and GDN-state fragmentation "
        "under 2 GB through hundreds of sessions)",
        "reserved_nbytes": "12 GiB, assumed: a 2B-parameter DiT in bf16 (about 4 GiB), its text "
        "encoder (about 5 GiB), VAE and activations",
        "step_s": "5 ms per session step and a 1 s period, assumed so that compute never binds: "
        "the RFC measured how many sessions memory holds, not deadlines",
        "bandwidth": "25 GB/s each way (PCIe 4, an A100's link), assumed",
    },
)
"""A Sana-WM-shaped session in RFC #4480's setting (see ``figures``)."""


def dreamzero_shape(plan: Mapping[str, Any], *, reserved_nbytes: int = 28 * GIB) -> DeployShape:
    """The DreamZero deploy shape from a `sessionstate plan --json` of DreamZero at ``deploy``.

    Parking moves the session's KV and parkable objects; its attributes stay (the plan's
    assumption). The step's new KV blocks (the plan's headroom) are reserved with the model.

    >>> plan = {"device_nbytes": 141 * 10**9, "host_nbytes": 2**40,
    ...         "bandwidth_bytes_per_s": 50e9, "step_headroom_nbytes": 0,
    ...         "session": {"kv_nbytes": 6 * GIB, "parkable_nbytes": GIB, "attrs_nbytes": 0}}
    >>> dreamzero_shape(plan).resident_capacity
    14
    """
    s = plan["session"]
    return DeployShape(
        name="dreamzero",
        objects={"kv": int(s["kv_nbytes"]), "parkable": int(s["parkable_nbytes"])},
        attrs_nbytes=int(s["attrs_nbytes"]),
        reserved_nbytes=reserved_nbytes + int(plan["step_headroom_nbytes"]),
        device_nbytes=int(plan["device_nbytes"]),
        host_nbytes=int(plan["host_nbytes"]),
        bandwidth=float(plan["bandwidth_bytes_per_s"]),
        step_s=(0.1,),
        chunk_period_s=0.75,
        ttfc_s=1.5,
        figures={
            "sizes": "`sessionstate plan --model dreamzero --preset deploy` (the size table on "
            "meta): KV, parkable objects and attributes per session",
            "reserved_nbytes": "28 GiB, assumed: DreamZero's 14B-parameter Wan backbone in "
            "bf16, plus the plan's headroom for one step's new KV blocks",
            "chunk_period_s": "0.75 s, assumed (LingBot's), so the two rows differ in sizes only",
            "ttfc_s": "1.5 s, assumed: two chunk periods",
            "step_s": _WHAT_IF_STEP.replace("LingBot", "LingBot (the other row)"),
            "bandwidth": "the plan's --bandwidth",
        },
    )
