"""The size tables in the docs (DreamZero, Cosmos3), rendered from `sessionstate sizes` output.

Two uses:

- As a library of renderers for ``docs/gen_tables.py``, which writes the tables into the
  pages: ``render`` turns a `sessionstate sizes --json` result (a page's
  ``<!-- sizes-table: data/sizes-deploy-400.json -->`` region) into a table, and
  ``render_plans`` turns `sessionstate plan --json` results of one model (a page's
  ``<!-- plan-table: data/plan-a.json data/plan-b.json -->`` region) into one session's
  bytes (from the first plan) and a column of sessions per plan. The numbers are never typed
  by hand; a missing or malformed file fails the rendering.
- As a script: ``python docs/gen_sizes.py`` re-runs
  ``sessionstate sizes --preset deploy --steps 400 --json`` (about 20 s of CPU on the meta
  device, the networks' calls replayed from their layouts; nothing is allocated) and
  rewrites ``docs/data/sizes-deploy-400.json``, then ``sessionstate sizes --model cosmos3
  --preset deploy --steps 8 --json`` into ``docs/data/sizes-cosmos3-deploy-8.json``. Run it
  when a model's state changes, and commit the result. It then writes the capacity plans the
  docs show (``docs/data/plan-*.json``): ``sessionstate plan --sizes-json FILE
  --device-bytes 80GiB`` (and ``141GiB``) ``--host-bytes 1TiB --bandwidth 50GB/s --json`` for
  each model, from the size tables just written, and last rewrites the pages' tables
  (``docs/gen_tables.py``).

``tests/cli/test_cli_plan.py`` checks that the committed plans are what `sessionstate plan`
computes from the committed size tables.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
DEFAULT_DATA = DOCS / "data" / "sizes-deploy-400.json"
COSMOS3_DATA = DOCS / "data" / "sizes-cosmos3-deploy-8.json"
MARKER = re.compile(r"<!--\s*sizes-table:\s*(?P<path>\S+)\s*-->")
PLAN_MARKER = re.compile(r"<!--\s*plan-table:\s*(?P<paths>[^>]+?)\s*-->")
PLAN_DEVICES = ("80GiB", "141GiB")
PLAN_HOST = "1TiB"
PLAN_BANDWIDTH = "50GB/s"
PLAN_SIZES = {"dreamzero": DEFAULT_DATA, "cosmos3": COSMOS3_DATA}
MIB = 1024 * 1024
GIB = 1024 * MIB

# What each value is, in a few words. The bucket and every number come from the JSON.
NOTES = {
    "vae_enc_feat_map": "Wan encoder causal-conv cache; replaced wholesale every body chunk",
    "vae_dec_feat_map": "Wan decoder causal-conv cache (`decode_frames`); replaced every step",
    "video_latents_across_time": "every generated latent chunk, on the host; kept for decode",
    "stitched_buffer": "ring of the last 4 stitched uint8 frames",
    "vae_encoder_out": "pre-quant encoder output: a 2-frame ring vs the whole history",
    "clip_feas": "image features of the window's start frame",
    "ys": "VAE conditioning of the window's start frame",
    "language": "prompt token ids (the reset check compares them)",
    "prompt_embeds": "prompt embeddings, encoded once per session",
    "vae_pending_body_frames": "pixel frames awaiting a 4-frame body chunk (at most 3)",
    "call_count": "counter",
    "current_start_frame": "counter",
    "vae_stream_initialized": "flag",
    "kv_cache": "denoiser K/V of the window's frames: blocks of the engine's paged pool",
    "text_kv": "reasoner K/V of every layer, prompt and negative prompt; encoded once",
    "context_latents": "ring of the last generated chunk(s): the next chunk's context",
    "video_latents": "every generated chunk, on the host",
    "rope_freqs": "RoPE cos/sin tables of the generation tokens, computed once",
    "prompt_tokens": "prompt token ids (the reset check compares them)",
    "negative_tokens": "negative-prompt token ids",
    "chunk_count": "counter",
    "random_key": "the noise's random state (stream, counter): one draw per step, split on fork",
}
BUCKET_LABEL = {"attrs": "attr", "object": "state object"}
OBJECT_TYPE = {"text_kv": "`EncodeOnceKV`", "random_key": "`RandomKey`"}


def fmt_bytes(n: int) -> str:
    """Bytes as the table shows them.

    >>> fmt_bytes(0), fmt_bytes(4096), fmt_bytes(632586240), fmt_bytes(47113175040)
    ('—', '4.0 KiB', '603.28 MiB', '43.88 GiB')
    >>> fmt_bytes(16)
    '16 B'
    """
    if n == 0:
        return "—"
    if n < 1024:
        return f"{n} B"
    if n < MIB // 10:
        return f"{n / 1024:.1f} KiB"
    if n < 10 * GIB:
        return f"{n / MIB:.2f} MiB"
    return f"{n / GIB:.2f} GiB"


def render(table: dict[str, Any]) -> str:
    """The markdown for one `sessionstate sizes --json` result."""
    rows = [
        "| value | bucket | managed path | bespoke path | what it is |",
        "|---|---|--:|--:|---|",
    ]
    for name, row in table["values"].items():
        managed, bespoke = row["managed_nbytes"], row["bespoke_nbytes"]
        bespoke_cell = fmt_bytes(bespoke) if bespoke == managed else f"**{fmt_bytes(bespoke)}**"
        rows.append(
            f"| `{name}` | {_bucket_label(name, row['bucket'])} | "
            f"{fmt_bytes(managed)} | {bespoke_cell} | {NOTES.get(name, '')} |"
        )
    session, many = table["session_nbytes"], table["sessions_64_nbytes"]
    rows.append(
        f"| **one session** | | **{fmt_bytes(session['managed'])}** | "
        f"**{fmt_bytes(session['bespoke'])}** | every value, each storage once |"
    )
    shared = table.get("bespoke_per_instance")
    note = "the default cap, all full"
    if shared:
        note += f"; the bespoke path keeps {', '.join(f'`{v}`' for v in shared)} once"
    rows.append(
        f"| **64 sessions** | | {fmt_bytes(many['managed'])} | {fmt_bytes(many['bespoke'])} | "
        f"{note} |"
    )
    if "text_kv_layers" in table:
        return "\n".join(rows) + "\n\n" + _cosmos3_caption(table) + "\n"
    feat = table["values"]["vae_enc_feat_map"]["managed_nbytes"]
    caption = (
        f"One session of the `{table['preset']}` preset after {table['steps']} steps, counted "
        f"on the meta device. `vae_enc_feat_map` is {table['vae_enc_feat_map_tensors']} "
        f"tensors totalling {feat / MIB} MiB; 64 of them alone are {64 * feat / GIB:.1f} GiB. "
        "A **bold** bespoke figure differs from the managed one."
    )
    return "\n".join(rows) + "\n\n" + caption + "\n"


def _bucket_label(name: str, bucket: str) -> str:
    if bucket == "object":
        return OBJECT_TYPE.get(name, BUCKET_LABEL["object"])
    return BUCKET_LABEL.get(bucket, bucket)


def _cosmos3_caption(table: dict[str, Any]) -> str:
    geo = table["text_kv_geometry"]
    kv = table["values"]["text_kv"]["managed_nbytes"]
    return (
        f"One session of the Cosmos3 `{table['preset']}` preset after {table['steps']} steps, "
        f"counted on the meta device. `text_kv` is {table['text_kv_layers']} layers x "
        f"{table['text_kv_branches']} branches of K and V, each (1, {geo['num_kv_heads']}, "
        f"{geo['text_len']}, {geo['head_dim']}) {geo['dtype']}: "
        f"{fmt_bytes(table['text_kv_pair_nbytes'])} per layer and branch, {fmt_bytes(kv)} per "
        f"session, {fmt_bytes(64 * kv)} for 64 sessions. The geometry is assumed (see "
        "`Cosmos3Config`)."
    )


def load(path: Path) -> dict[str, Any]:
    """Read and check a `sessionstate sizes --json` file."""
    try:
        table: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        msg = f"{path} is missing; regenerate it with `python docs/gen_sizes.py`."
        raise FileNotFoundError(msg) from None
    missing = {"preset", "steps", "values", "session_nbytes", "sessions_64_nbytes"} - set(table)
    if missing:
        msg = f"{path} is not `sessionstate sizes --json` output: missing {sorted(missing)}."
        raise ValueError(msg)
    return table


def plan_path(model: str, device: str) -> Path:
    """Where the committed plan of ``model`` at ``device`` bytes lives.

    >>> plan_path("dreamzero", "80GiB").name
    'plan-dreamzero-deploy-80GiB.json'
    """
    return DOCS / "data" / f"plan-{model}-deploy-{device}.json"


def plan_argv(model: str, device: str) -> list[str]:
    """The `sessionstate plan` arguments of a committed plan (relative to the repository)."""
    sizes = PLAN_SIZES[model].relative_to(DOCS.parent)
    return [
        "plan", "--model", model, "--preset", "deploy", "--sizes-json", str(sizes),
        "--device-bytes", device, "--host-bytes", PLAN_HOST, "--bandwidth", PLAN_BANDWIDTH,
        "--json",
    ]  # fmt: skip


def render_plans(plans: list[dict[str, Any]]) -> str:
    """The markdown for `sessionstate plan --json` results of one model: bytes, then sessions."""
    from sessionstate.cli._plan import fmt_plan_bytes, fmt_seconds

    first, s = plans[0], plans[0]["session"]
    b = fmt_plan_bytes
    rows = [
        "| one session | on the device | on the host |",
        "|---|--:|--:|",
        f"| KV window (engine) | {b(s['kv_nbytes'])} | |",
        f"| parkable state objects | {b(s['parkable_nbytes'])} | |",
        f"| unparkable state objects (the random key; stay when parked) "
        f"| {b(s['unparkable_nbytes'])} | |",
        f"| attributes (stay on the device when parked) | {b(s['attrs_nbytes'])} | |",
        f"| kept on the host anyway | | {b(s['host_kept_nbytes'])} |",
        f"| **resident** | **{b(s['device_nbytes'])}** | {b(s['host_kept_nbytes'])} |",
        f"| **parked** | {b(s['parked_device_nbytes'])} | **{b(s['parked_host_nbytes'])}** |",
    ]
    if first["step_headroom_nbytes"]:
        rows.append(
            f"| one step's new KV blocks (once per device) | {b(first['step_headroom_nbytes'])} | |"
        )
    head = " | ".join(f"{b(p['device_nbytes'])} device" for p in plans)
    rows += ["", f"| {b(first['host_nbytes'])} host, {_gbps(first)} | {head} |"]
    rows.append("|---|" + "--:|" * len(plans))

    def line(label: str, cells: list[str]) -> None:
        rows.append(f"| {label} | " + " | ".join(cells) + " |")

    line("available for sessions", [b(p["available_nbytes"]) for p in plans])
    line(
        "sessions resident, nothing parked",
        [str(p["sessions_resident_without_parking"]) for p in plans],
    )
    line("**sessions resident**", [f"**{p['sessions_resident']}**" for p in plans])
    line("**sessions parked**", [f"**{p['sessions_parked']}**" for p in plans])
    line("sessions in all", [str(p["sessions_total"]) for p in plans])
    line("device used", [b(p["device_used_nbytes"]) for p in plans])
    line("host used", [b(p["host_used_nbytes"]) for p in plans])
    line(
        f"swap one session in / out ({b(s['swap_nbytes'])})",
        [f"{fmt_seconds(p['swap_in_s'])} / {fmt_seconds(p['swap_out_s'])}" for p in plans],
    )
    from sessionstate.models._registry import get_model

    caption = (
        f"`sessionstate plan` for {get_model(first['model']).title} at preset "
        f"`{first['preset']}` after {first['steps']} steps, from the committed size table; "
        "nothing reserved for the model's own weights and workspace (`--reserved-bytes`: the "
        "size table does not know them)."
    )
    return "\n".join(rows) + "\n\n" + caption + "\n"


def _gbps(plan: dict[str, Any]) -> str:
    return f"{plan['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s"


def load_plan(path: Path) -> dict[str, Any]:
    """Read and check a `sessionstate plan --json` file."""
    try:
        plan: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        msg = f"{path} is missing; regenerate it with `python docs/gen_sizes.py`."
        raise FileNotFoundError(msg) from None
    if "sessions_resident" not in plan or "session" not in plan:
        msg = f"{path} is not `sessionstate plan --json` output."
        raise ValueError(msg)
    return plan


def write_plans() -> None:
    """Run `sessionstate plan` on the committed size tables and rewrite the committed plans."""
    for model in PLAN_SIZES:
        for device in PLAN_DEVICES:
            cmd = [sys.executable, "-m", "sessionstate.cli", *plan_argv(model, device)]
            result = subprocess.run(
                cmd, check=True, capture_output=True, text=True, cwd=DOCS.parent
            )
            path = plan_path(model, device)
            path.write_text(result.stdout, encoding="utf-8")
            print(f"wrote {path.relative_to(DOCS.parent)}")


def main() -> int:
    """Re-run ``sessionstate sizes`` and rewrite the committed JSON."""
    cmd = [
        sys.executable, "-m", "sessionstate.cli", "sizes",
        "--preset", "deploy", "--steps", "400", "--json",
    ]  # fmt: skip
    result = subprocess.run(cmd, check=True, capture_output=True, text=True)
    table = json.loads(result.stdout)
    DEFAULT_DATA.parent.mkdir(parents=True, exist_ok=True)
    DEFAULT_DATA.write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {DEFAULT_DATA.relative_to(DOCS.parent)}")
    cmd = [
        sys.executable, "-m", "sessionstate.cli", "sizes", "--model", "cosmos3",
        "--preset", "deploy", "--steps", "8", "--json",
    ]  # fmt: skip
    result = subprocess.run(cmd, check=True, capture_output=True, text=True)
    COSMOS3_DATA.write_text(result.stdout, encoding="utf-8")
    print(f"wrote {COSMOS3_DATA.relative_to(DOCS.parent)}")
    write_plans()
    import gen_tables  # beside this module; imports this one, so not at the top

    return gen_tables.main([])


if __name__ == "__main__":
    raise SystemExit(main())
