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
# # 03: byte accounting
#
# What `ss.nbytes_by_device` counts, case by case, next to the naive sum a hand-rolled
# model would use: `numel() * element_size()` over every tensor (and `nbytes` over every
# NumPy array). Then why storages are identified by storage object on the `meta` device,
# and finally the DreamZero size table at the deploy geometry, computed on `meta` without
# allocating a byte.

# %%
import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from nbsetup import WIDTH, GiB, MiB, plt, show

import sessionstate as ss
from sessionstate.models.dreamzero import BUCKETS, DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode


# %%
def library(tree: object) -> int:
    return sum(ss.nbytes_by_device(tree).values())


def naive(tree: object) -> int:
    """numel * element_size over every tensor leaf; nbytes over every NumPy leaf."""
    total = 0
    for leaf in ss.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
        elif isinstance(leaf, np.ndarray):
            total += leaf.nbytes
    return total


class Opaque:  # not a pytree node: a leaf, and its tensor is invisible
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@ss.record
class Holder:  # the same, as a record: its tensor is a child
    t: torch.Tensor


x = torch.zeros(1024)  # one 4 KiB allocation
arr = np.zeros(100, dtype=np.float32)
ring = ss.LatentBuffer(dim=0).allocate().commit(x[None])
sparse = torch.zeros(100, 100)
sparse[0, 0] = 1.0
sparse = sparse.to_sparse()  # one non-zero: 2 int64 indices + 1 float

cases: dict[str, tuple[object, int]] = {  # name -> (tree, the bytes it really keeps alive)
    "one tensor": (x, 4096),
    "narrow slice x[:8]": (x[:8], 4096),
    "x[:8].clone()": (x[:8].clone(), 32),
    "4 views of x": ({"a": x, "b": x.view(32, 32), "c": x[10:20], "d": x.detach()}, 4096),
    "expand(1000, 4)": (torch.zeros(4).expand(1000, 4), 16),
    "attr aliases a chunk": (ss.SessionState(objects={"r": ring}, attrs={"a": x[:8]}), 4096),
    "array + from_numpy": ([arr, torch.from_numpy(arr)], 400),
    "sparse COO": (sparse, 20),
    "two meta tensors": ([torch.empty(256, device="meta") for _ in range(2)], 2048),
    "ints, str, None": ({"step": 3, "name": "s", "flag": None}, 0),
    "@record holding x": (Holder(x), 4096),
    "opaque object holding x": (Opaque(x), 0),
}
print(f"{'case':26} {'library':>8} {'naive':>8} {'kept alive':>10}")
for name, (tree, alive) in cases.items():
    print(f"{name:26} {library(tree):>8,} {naive(tree):>8,} {alive:>10,}")

# %% [markdown]
# The library reports what each tree keeps alive: a slice keeps its whole allocation, four
# views of one tensor are one allocation, an expanded tensor owns 16 bytes, a sparse
# tensor owns its indices and values. The last row is the one thing it cannot see: a
# tensor inside an object that is not a pytree node. Make such classes records.

# %%
names = list(cases)
fig, ax = plt.subplots(figsize=(WIDTH, 4.2))
ys = np.arange(len(names))
ax.barh(ys - 0.2, [max(library(cases[n][0]), 1) for n in names], 0.4, label="library")
ax.barh(ys + 0.2, [max(naive(cases[n][0]), 1) for n in names], 0.4, label="naive sum")
ax.set(yticks=ys, yticklabels=names, xscale="log", xlabel="bytes (0 drawn as 1)")
ax.invert_yaxis()
ax.legend()
show(fig)

# %% [markdown]
# ## Storage identity on `meta`
#
# Every storage on the `meta` device has data pointer 0. Deduplicating by data pointer
# would make all meta tensors one storage; the library identifies a storage without memory
# by its storage object instead.

# %%
metas = [torch.empty(256, device="meta") for _ in range(4)]  # 1 KiB each
by_pointer: dict[int, int] = {}
for t in metas:
    by_pointer.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
print("data pointers:", [t.data_ptr() for t in metas])
print("deduplicated by data pointer:", sum(by_pointer.values()), "bytes")
print("library:", ss.nbytes_by_device([*metas, metas[0][:10]]))

# %% [markdown]
# ## The DreamZero size table, on `meta`
#
# Two DreamZero pipelines at the deploy geometry (three 180x320 cameras stitched to
# 352x640, bfloat16, the Wan 2.1 VAE at its released width) are built on `meta` and run
# one session for 12 steps: every shape is exact and nothing is allocated. Values that
# stop changing after the first body chunk must equal the committed 400-step table that
# the docs render; the two that grow must follow their per-step rate to it.

# %%
STEPS = 12
deploy = DreamZeroConfig.preset("deploy")
held: dict[str, dict[str, int]] = {}
feat_map: tuple[torch.Tensor | None, ...] = ()
for flag, path in (("1", "managed"), ("0", "bespoke")):
    pipe = DreamZeroPipeline(
        deploy, device="meta", host_device="meta", environ={ss.ENV_ENABLE: flag}
    )
    for sid, obs in scripted_episode(
        deploy, steps=STEPS, sessions=1, seed=0, prompt_change_every=STEPS + 1
    ):
        pipe.forward(obs, sid)
    values = pipe.session_values("session-0")
    held[path] = {n: sum(ss.nbytes_by_device(v).values()) for n, v in values.items()}
    if path == "managed":
        assert isinstance(values["vae_enc_feat_map"], tuple)
        feat_map = values["vae_enc_feat_map"]
print(f"{'value':26} {'managed MiB':>12} {'bespoke MiB':>12}   after {STEPS} steps, meta")
for name in BUCKETS:
    managed_mib, bespoke_mib = held["managed"][name] / MiB, held["bespoke"][name] / MiB
    print(f"{name:26} {managed_mib:>12.5f} {bespoke_mib:>12.5f}")
print(f"vae_enc_feat_map: {sum(t is not None for t in feat_map)} tensors")

# %%
root = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "pyproject.toml").exists())
committed: dict[str, Any] = json.loads((root / "docs/data/sizes-deploy-400.json").read_text())
N = committed["steps"]


def latent_frames(steps: Any) -> Any:  # video latents: the reference frame + 2 per step
    return 1 + 2 * steps


def encoded_frames(steps: Any) -> Any:  # the seed frame + one body chunk every 4 steps
    return 1 + (steps - 1) // 4


per_video_frame = held["managed"]["video_latents_across_time"] // latent_frames(STEPS)
per_encoded_frame = held["bespoke"]["vae_encoder_out"] // encoded_frames(STEPS)
predicted = {path: dict(held[path]) for path in held}
for path in predicted:
    predicted[path]["video_latents_across_time"] = per_video_frame * latent_frames(N)
predicted["bespoke"]["vae_encoder_out"] = per_encoded_frame * encoded_frames(N)

print(f"{'value':26} {'predicted 400':>14} {'committed 400':>14}   (managed / bespoke)")
for name in committed["values"]:
    row = committed["values"][name]
    for path in ("managed", "bespoke"):
        print(
            f"{name if path == 'managed' else '':26} {predicted[path][name]:>14,} "
            f"{row[path + '_nbytes']:>14,}   {path}"
        )

# %%
s: npt.NDArray[np.int64] = np.arange(1, N + 1)
fig, ax = plt.subplots(figsize=(WIDTH, 4))
feat_mib = held["managed"]["vae_enc_feat_map"] / MiB
# The denoiser's KV holds a window of latent frames, full long before step 12 (it equals the
# 400-step figure): engine-owned, the largest value of a session by a factor of ten.
ax.axhline(held["managed"]["kv_cache"] / MiB, color="C4", label="kv_cache (engine, window full)")
ax.plot(s, np.full(N, feat_mib), label="vae_enc_feat_map (object)")
ax.plot(s, latent_frames(s) * per_video_frame / MiB, label="video_latents_across_time")
ax.plot(s, encoded_frames(s) * per_encoded_frame / MiB, label="vae_encoder_out, bespoke")
ax.plot(
    s,
    np.minimum(encoded_frames(s), 2) * per_encoded_frame / MiB,
    label="vae_encoder_out, managed ring",
)
for name in ("kv_cache", "vae_enc_feat_map", "video_latents_across_time", "vae_encoder_out"):
    for path, marker in (("managed", "o"), ("bespoke", "s")):
        nbytes = committed["values"][name][path + "_nbytes"]
        ax.plot(N, nbytes / MiB, marker, color="k", ms=3)
ax.set(
    yscale="log",
    xlabel="step",
    ylabel="MiB",
    title="one DreamZero session at deploy geometry (black: committed table)",
)
ax.legend(loc="center right")
show(fig)

# %% [markdown]
# ## What this notebook shows, checked

# %%
# Each case counts what it keeps alive; the naive sum is wrong on slices, views,
# expanded and sparse tensors, and aliases.
for name, (tree, alive) in cases.items():
    assert library(tree) == alive, name
assert sum(library(cases[n][0]) != naive(cases[n][0]) for n in cases) >= 6
# Meta: deduplicating by data pointer sees one storage; the library sees four.
assert set(by_pointer) == {0}
assert sum(by_pointer.values()) == 1024
assert ss.nbytes_by_device(metas) == {"meta": 4096}
# The deploy geometry on meta: the figures the size table in the docs states.
assert held["managed"]["vae_enc_feat_map"] == 632586240  # bytes
assert held["managed"]["vae_enc_feat_map"] / MiB == 603.28125
assert sum(t is not None for t in feat_map) == 24
assert held["managed"]["vae_encoder_out"] / MiB == 0.4296875  # the ring: 2 frames
assert per_encoded_frame / MiB == 0.21484375  # the bespoke history, per latent frame
assert round(64 * held["managed"]["vae_enc_feat_map"] / GiB, 1) == 37.7
assert held["managed"]["kv_cache"] == held["bespoke"]["kv_cache"] == 6488064000  # 6.04 GiB
# ... and the committed table the docs render: steady values equal, growing ones on rate.
for name in committed["values"]:
    for path in ("managed", "bespoke"):
        assert predicted[path][name] == committed["values"][name][path + "_nbytes"], name
print("all checks passed")
