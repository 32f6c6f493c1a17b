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
# # 05: snapshots and migration
#
# Two DreamZero sessions (tiny preset, managed path) run an interleaved scripted episode.
# Halfway through, session `session-0` moves from one pipeline to another: its manager
# writes a snapshot (`manager.snapshot`), the other pipeline's manager restores it
# (`manager.restore`), and the first drops it. This is what `sessionstate.distributed`
# does between Ray workers, without Ray. A reference pipeline runs the same episode without
# moving anything; every output of the moved run must be bit-identical (`torch.equal`) to
# it.
#
# After every request we also measure the session's snapshot (`dumps_state`) against the
# bytes it holds (`nbytes_by_device`): a snapshot is the session's storages, once each, plus
# a JSON header.

# %%
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from nbsetup import WIDTH, KiB, plt, show

import sessionstate as ss
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline, DreamZeroSession
from sessionstate.models.dreamzero.episode import scripted_episode

# %%
STEPS, MOVE_AT = 6, 6  # 6 rounds of 2 sessions; session-0 moves before request 6
cfg = DreamZeroConfig.preset("tiny")
episode = list(scripted_episode(cfg, steps=STEPS, sessions=2, seed=0))


def pipeline() -> DreamZeroPipeline:
    return DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1"})


def manager(pipe: DreamZeroPipeline) -> ss.SessionStateManager[DreamZeroSession]:
    """The managed path's manager (a bespoke pipeline has none)."""
    assert pipe.manager is not None
    return pipe.manager


reference = pipeline()
expected = [reference.forward(obs, sid) for sid, obs in episode]

source, destination = pipeline(), pipeline()
owner = {"session-0": source, "session-1": source}
spool = Path(tempfile.mkdtemp())
log: list[dict[str, Any]] = []
moved_file = 0
for i, (sid, obs) in enumerate(episode):
    if i == MOVE_AT:
        path = spool / "session-0.safetensors"
        manager(source).snapshot("session-0", path)  # a peek: LRU order and counters untouched
        manager(destination).restore("session-0", path)  # admitted like a put
        source.drop_session("session-0")
        owner["session-0"] = destination
        moved_file = path.stat().st_size
    out = owner[sid].forward(obs, sid)
    state = manager(owner[sid]).peek(sid)
    log.append(
        {
            "session": sid,
            "identical": torch.equal(out.actions, expected[i].actions)
            and torch.equal(out.video_latents, expected[i].video_latents),
            "snapshot": len(ss.dumps_state(state)),
            "held": sum(ss.nbytes_by_device(state).values()),
        }
    )
print("source holds", source.session_ids(), "| destination holds", destination.session_ids())
print(f"session-0's snapshot file: {moved_file:,} bytes")
print("every output bit-identical to the unmoved run:", all(row["identical"] for row in log))

# %% [markdown]
# ## Snapshot size against held bytes
#
# Per request, the snapshot of the session just stepped (its bytes, `dumps_state`) and the
# bytes the session holds. The header (structure, dtypes, strides, checksums) is the small
# constant difference between the two lines; the vertical line marks the move.

# %%
fig, ax = plt.subplots(figsize=(WIDTH, 3.5))
for sid, colour in (("session-0", "C0"), ("session-1", "C1")):
    xs = [i + 1 for i, row in enumerate(log) if row["session"] == sid]
    rows = [row for row in log if row["session"] == sid]
    ax.plot(xs, [r["snapshot"] / KiB for r in rows], "o-", color=colour, label=f"{sid}: snapshot")
    ax.plot(xs, [r["held"] / KiB for r in rows], "x--", color=colour, label=f"{sid}: held")
ax.axvline(MOVE_AT + 0.5, color="0.3", lw=1)
ax.set(xlabel="request (line: session-0 moves)", ylabel="KiB", title="snapshot and held bytes")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
show(fig)

# %% [markdown]
# ## From bytes, in a fresh pipeline
#
# A snapshot is also a `bytes` object for a wire. A session restored from bytes into a
# pipeline that never saw it is the same record (`tree_equal`: every bit, static field and
# alias), and continues bit-identically.

# %%
latest = manager(destination).require("session-0")
data = ss.dumps_state(latest)
fresh = pipeline()
manager(fresh).put("session-0", ss.loads_state(data, expect=DreamZeroSession))
print(
    "loaded record equals the stored one:",
    ss.tree_equal(manager(fresh).require("session-0"), latest),
)
nxt = next(iter(scripted_episode(cfg, steps=1, sessions=1, seed=1)))[1]
a, b = fresh.forward(nxt, "session-0"), destination.forward(nxt, "session-0")
print("next step bit-identical:", torch.equal(a.actions, b.actions))

# %% [markdown]
# ## What this notebook shows, checked

# %%
assert all(row["identical"] for row in log)
assert source.session_ids() == ["session-1"]
assert destination.session_ids() == ["session-0"]
for row in log:  # storages once each, plus a header of at most a few KiB
    assert 0 < row["snapshot"] - row["held"] < 32 * KiB
assert ss.tree_equal(ss.loads_state(data, expect=DreamZeroSession), latest)
assert torch.equal(a.actions, b.actions)
assert torch.equal(a.video_latents, b.video_latents)
shutil.rmtree(spool)
print("all checks passed")
