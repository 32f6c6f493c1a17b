# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01: a DreamZero session, step by step
#
# One DreamZero session (the `tiny` preset, CPU) runs for 60 steps on both session-state
# paths:
#
# - **managed**: the pure `step(state, obs) -> (state, out)`; we thread the immutable
#   `DreamZeroSession` record ourselves and keep every version;
# - **bespoke**: the hand-rolled mutable state, updated in place by `forward`.
#
# After each step we count the bytes of every value, and of each bucket (state objects,
# attributes), with `ss.nbytes_by_device`. The prompt changes at step 40 (a session
# reset), and the local attention window (21 latent frames here) rolls over every 10
# steps (a window reset).

# %%
import itertools
from typing import Any

import torch
from matplotlib.axes import Axes
from nbsetup import WIDTH, KiB, plt, show

import sessionstate as ss
from sessionstate.models.dreamzero import BUCKETS, DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode

# %%
STEPS = 60
cfg = DreamZeroConfig.preset("tiny", local_attn_size=21)
episode = list(scripted_episode(cfg, steps=STEPS, sessions=1, seed=0, prompt_change_every=40))
managed = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1"})
bespoke = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "0"})
print("managed:", managed.managed, "| bespoke:", bespoke.managed)


# %%
def value_bytes(values: dict[str, object]) -> dict[str, int]:
    """Bytes of each value on its own."""
    return {name: sum(ss.nbytes_by_device(v).values()) for name, v in values.items()}


def bucket_bytes(values: dict[str, object]) -> dict[str, int]:
    """Bytes of each bucket, each storage once."""
    return {
        bucket: sum(
            ss.nbytes_by_device([v for n, v in values.items() if BUCKETS[n] == bucket]).values()
        )
        for bucket in ("object", "attrs")
    }


def bespoke_history_frames(history: object) -> int:
    """Latent frames in the bespoke path's encoder output (one growing tensor)."""
    assert isinstance(history, torch.Tensor)
    return history.shape[2]


state = managed.new_session()
records = []  # every version of the managed session
log: list[dict[str, Any]] = []
# id(encoder output chunk) -> (number, chunk): numbers in encode order
chunk_number: dict[int, tuple[int, torch.Tensor]] = {}
for sid, obs in episode:
    state, out = managed.step(state, obs)
    records.append(state)
    ref = bespoke.forward(obs, sid)
    for chunk in state.vae_encoder_out.view():
        chunk_number.setdefault(id(chunk), (len(chunk_number), chunk))
    m_values, b_values = state.values(), bespoke.session_values(sid)
    log.append(
        {
            "reset": out.reset,
            "identical": torch.equal(out.actions, ref.actions)
            and torch.equal(out.video_latents, ref.video_latents),
            "managed": value_bytes(m_values),
            "bespoke": value_bytes(b_values),
            "managed_buckets": bucket_bytes(m_values),
            "bespoke_buckets": bucket_bytes(b_values),
            "ring": [chunk_number[id(c)][0] for c in state.vae_encoder_out.view()],
            "history_frames": bespoke_history_frames(b_values["vae_encoder_out"]),
            "encoded": len(chunk_number),
        }
    )
steps = range(1, STEPS + 1)
session_resets = [i + 1 for i, row in enumerate(log) if row["reset"] == "session"]
window_resets = [i + 1 for i, row in enumerate(log) if row["reset"] == "inference"]
print("session resets at steps", session_resets)
print("window resets at steps ", window_resets)
print("outputs bit-identical at every step:", all(row["identical"] for row in log))


# %% [markdown]
# ## The encoder output: a ring against the whole history
#
# `vae_encoder_out` is the only value whose bytes differ between the paths. The bespoke
# path concatenates every encoded latent frame (one every four steps) and keeps it until
# the session resets; a window reset keeps it. The managed path keeps a ring of
# `num_frame_per_block` = 2 frames. The outputs above are bit-identical all the same
# (see the docs' bit-identity notes).


# %%
def mark_resets(ax: Axes) -> None:
    for s in window_resets:
        ax.axvline(s, color="0.75", ls=":", lw=1)
    for s in session_resets:
        ax.axvline(s, color="0.3", lw=1)


fig, ax = plt.subplots(figsize=(WIDTH, 3.5))
mark_resets(ax)
for path, style in (("bespoke", "C3"), ("managed", "C0")):
    ax.plot(
        steps,
        [row[path]["vae_encoder_out"] / KiB for row in log],
        style,
        lw=2,
        label=f"{path}: " + ("whole history" if path == "bespoke" else "ring of 2"),
    )
ax.set(
    xlabel="step (solid: session reset, dotted: window reset)",
    ylabel="KiB",
    title="vae_encoder_out bytes, one DreamZero session (tiny)",
)
ax.set_ylim(bottom=0)
ax.legend(loc="upper left")
show(fig, "state_evolution.png")

# %% [markdown]
# ## Every value, on both paths
#
# Bytes per value (log scale). Everything but `vae_encoder_out` is the same on both paths:
# the causal-conv cache is constant once the first body chunk is encoded, the video
# latents grow (they are the session's output) until the session resets, the frames ring
# fills to 4, and the window conditioning is replaced at every window reset.

# %%
names = [n for n in BUCKETS if any(row["managed"][n] or row["bespoke"][n] for row in log)]
# Ten lines on a log axis: each value gets a colour, a line style and a marker of its own.
MARKERS, LINES = "os^vDPX*h<>", ("-", "--", "-.", ":")
fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 4.8), sharey=True, layout="constrained")
for ax, path in zip(axes, ("managed", "bespoke"), strict=True):
    mark_resets(ax)
    for i, name in enumerate(names):
        # Zero bytes (an empty value) break the line rather than drop off the log axis.
        y = [row[path][name] or float("nan") for row in log]
        ls, marker = LINES[i % len(LINES)], MARKERS[i % len(MARKERS)]
        ax.plot(
            steps,
            y,
            f"C{i % 10}",
            ls=ls,
            marker=marker,
            ms=4,
            markevery=(i % 6, 6),
            lw=1,
            label=name,
        )
    ax.set(title=path, xlabel="step", yscale="log")
axes[0].set_ylabel("bytes")
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=3)
show(fig)

# %%
last = log[-1]
print(f"{'value':26} {'bucket':7} {'managed':>10} {'bespoke':>10}   after {STEPS} steps")
for name in BUCKETS:
    print(f"{name:26} {BUCKETS[name]:7} {last['managed'][name]:>10,} {last['bespoke'][name]:>10,}")

# %% [markdown]
# ## Per bucket
#
# The same bytes, by bucket, each storage counted once per bucket. The state objects
# differ between the paths by the encoder output alone, and are dominated, at this
# geometry as at the deploy one, by the Wan encoder's causal-conv cache
# `vae_enc_feat_map`: a state object (a `TensorCache`), because the byte budget can park
# it, whatever its size. The attributes are the same on both paths and small (under
# 82 KiB here, most of it `vae_pending_body_frames`); the engine-owned `kv_cache` is
# neither bucket and is left out of these two panels.

# %%
fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.5))
for ax, bucket, title in zip(axes, ("object", "attrs"), ("state objects", "attrs"), strict=True):
    mark_resets(ax)
    for path, style in (("bespoke", "C3-"), ("managed", "C0--")):
        ax.plot(steps, [row[f"{path}_buckets"][bucket] / KiB for row in log], style, label=path)
    ax.set(title=title, xlabel="step", ylim=(0, None))
axes[0].set_ylabel("KiB")
axes[0].legend(loc="upper left")
fig.tight_layout()
show(fig)

# %% [markdown]
# ## What the ring holds
#
# Each encoded latent frame gets a number, in encode order. At every step the managed
# ring holds the two newest (dots); the bespoke history holds every frame since the
# session began (the bar). Both are reset by the session reset at step 40, and neither
# by a window reset.

# %%
fig, ax = plt.subplots(figsize=(WIDTH, 3.5))
mark_resets(ax)
for s, row in zip(steps, log, strict=True):
    ax.vlines(
        s, row["encoded"] - row["history_frames"], row["encoded"] - 1, color="C3", lw=3, alpha=0.35
    )
    ax.plot([s] * len(row["ring"]), row["ring"], "o", color="C0", ms=3)
ax.plot([], [], color="C3", lw=3, alpha=0.35, label="bespoke history")
ax.plot([], [], "o", color="C0", ms=3, label="managed ring")
ax.set(xlabel="step", ylabel="encoded latent frame #", title="vae_encoder_out contents")
ax.legend(loc="upper left")
show(fig)

# %% [markdown]
# ## Structural sharing
#
# We kept all 60 versions of the managed session. A commit stores a reference to the new
# chunk next to references to the chunks already held, so consecutive versions share
# every chunk but the newest, and all 60 versions together hold far less than 60 copies
# would. What they do not share is the state object replaced wholesale at every body
# chunk, `vae_enc_feat_map`: each replacement is a new cache, so most of what the 60
# versions hold together is the 15 or so caches the session went through. None of the versions
# changed after it was made.

# %%
together = sum(ss.nbytes_by_device(records).values())
separately = sum(sum(ss.nbytes_by_device(r).values()) for r in records)
caches = sum(ss.nbytes_by_device([r.vae_enc_feat_map for r in records]).values())
n_caches = len({id(r.vae_enc_feat_map) for r in records})
latest = sum(ss.nbytes_by_device(records[-1]).values())
print(f"latest version:             {latest:>11,} B")
print(f"all 60 versions, together:  {together:>11,} B")
print(f"  of which {n_caches} feature caches: {caches:>11,} B")
print(f"all 60 versions, as copies: {separately:>11,} B")


def shares_all_but_newest(prev: ss.StateObject, cur: ss.StateObject) -> bool:
    """Every chunk ``cur`` holds, but the one it just committed, is one ``prev`` held."""
    assert isinstance(prev, ss.LatentBuffer)
    assert isinstance(cur, ss.LatentBuffer)
    return all(any(c is p for p in prev.view()) for c in cur.view()[:-1])


buffers = ("stitched_buffer", "video_latents_across_time", "vae_encoder_out")
shared = all(
    shares_all_but_newest(prev.object(name), cur.object(name))
    for prev, cur in itertools.pairwise(records)
    for name in buffers
)
print("consecutive versions share every chunk but the newest:", shared)

# %% [markdown]
# ## What this notebook shows, checked

# %%
ring = [row["managed"]["vae_encoder_out"] for row in log]
history = [row["bespoke"]["vae_encoder_out"] for row in log]
nfpb = cfg.num_frame_per_block
full = [b for b, row in zip(ring, log, strict=True) if len(row["ring"]) == nfpb]

# The paths agree on every output, bit for bit.
assert all(row["identical"] for row in log)
# The ring's bytes are constant once it fills, and never more than that.
assert full
assert len(set(full)) == 1
assert max(ring) == full[0]
# The bespoke history climbs between session resets: one frame every 4 steps.
assert session_resets == [1, 41]
assert window_resets == [11, 21, 31, 51]
per_frame = full[0] // nfpb
for a, b in ((0, 40), (40, 60)):
    seg = history[a:b]
    assert all(x <= y for x, y in itertools.pairwise(seg))
    assert seg[-1] > seg[0]
    assert seg[-1] == (1 + (b - a - 1) // 4) * per_frame
assert history[39] == 5 * full[0]  # 10 frames after 40 steps, against the ring's 2
# Every other value holds the same bytes on both paths, at every step.
assert all(
    row["managed"][n] == row["bespoke"][n] for row in log for n in BUCKETS if n != "vae_encoder_out"
)
# The ring holds the two newest encoded frames; the history all since the session began.
for row in log:
    assert row["ring"] == list(range(row["encoded"] - len(row["ring"]), row["encoded"]))
# Sharing: a commit copies nothing, 60 versions cost far less than 60 copies, and
# what they do not share is the replaced-wholesale feature cache.
assert shared
assert together < separately / 3
assert caches > together / 2
assert all(value_bytes(r.values()) == row["managed"] for r, row in zip(records, log, strict=True))
print("all checks passed")
