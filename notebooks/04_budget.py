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
# # 04: memory under a byte budget
#
# Four sessions are served round robin by a `SessionStateManager` with a byte budget on
# the `cpu` device that holds the state objects of two of them. Each session is a feature
# cache (a `TensorCache`, replaced wholesale every step, as DreamZero's encoder cache is)
# and a small step counter. Sessions differ in size: session `sK` holds `K + 1` times
# 256 KiB.
#
# A machine without a GPU has one memory, so the budget parks to the **disk** tier here
# (the host tier would move bytes within the same RAM); on a GPU the budget would be on
# `cuda:0` and the host tier would park into pinned host memory. After every request we
# record, per session, its resident bytes (`nbytes_by_session`) and its parked bytes (what
# its `ParkedObject`s hold on disk), and which sessions were parked or unparked.

# %%
from typing import Any

import torch
from nbsetup import WIDTH, KiB, plt, show

import sessionstate as ss

# %%
SESSIONS, ROUNDS = 4, 6
IDS = [f"s{k}" for k in range(SESSIONS)]
SIZE = {sid: 256 * KiB * (k + 1) for k, sid in enumerate(IDS)}  # bytes of each cache
BUDGET = SIZE["s3"] + SIZE["s2"] + 64 * KiB  # the two largest caches fit, with room to spare


class Session(ss.SessionState):
    steps = ss.SessionAttr(0, coerce=int, doc="Completed steps.")


def new_session() -> Session:
    return Session(objects={"cache": ss.TensorCache(name="cache").allocate()})


def step(state: Session, sid: str) -> Session:
    """Pure: a new cache every step (the old one is never written into)."""
    cache = state.object("cache")
    fresh = torch.full((SIZE[sid] // 4,), float(state.steps + 1))
    return state.with_object("cache", cache.commit((fresh,))).with_attrs(steps=state.steps + 1)


def parked_bytes(state: ss.SessionState | None) -> int:
    """Bytes the session's parked objects hold in the park tier (0 when resident)."""
    if state is None:
        return 0
    return sum(
        sum(obj.nbytes_parked.values())
        for obj in state.objects.values()
        if isinstance(obj, ss.ParkedObject)
    )


manager: ss.SessionStateManager[Session] = ss.SessionStateManager(
    max_bytes={"cpu": BUDGET}, park_tier="disk"
)
log: list[dict[str, Any]] = []
for _round in range(ROUNDS):
    for sid in IDS:
        was_parked = {s: parked_bytes(manager.peek(s)) > 0 for s in IDS}
        state = manager.get_or_create(sid, new_session)  # unparks `sid` if it was parked
        manager.put(sid, step(state, sid))  # may park the least recently used sessions
        resident = manager.nbytes_by_session()
        parked = {s: parked_bytes(manager.peek(s)) for s in IDS}
        stats = manager.stats()
        log.append(
            {
                "request": sid,
                "resident": {s: sum(resident.get(s, {}).values()) for s in IDS},
                "parked": parked,
                "parks": [s for s in IDS if parked[s] and not was_parked[s]],
                "unparks": [s for s in IDS if was_parked[s] and not parked[s]],
                "nbytes_cpu": stats.get("nbytes:cpu", 0),
                "nbytes_parked_disk": stats["nbytes_parked:disk"],
            }
        )
stats = manager.stats()
print(f"budget: {BUDGET / KiB:,.0f} KiB on cpu; caches: {[SIZE[s] // KiB for s in IDS]} KiB")
print({k: stats[k] for k in ("sessions", "evictions", "parks", "unparks", "parked_sessions")})

# %% [markdown]
# ## The timeline
#
# Top: each session's resident bytes, stacked, against the budget; bottom: each session's
# parked bytes. A triangle marks a park (down) or an unpark (up) of that session, at the
# request that caused it. Every request for a parked session unparks it, and the planner
# then parks the least recently used sessions until the device fits again. In a round
# robin the least recently used session is the one served next, so almost every request
# is a park and an unpark: a budget that holds fewer sessions than a round robin visits
# pays one round trip of a cache per request (see the docs' Memory budget page for what
# that costs). Nothing is lost: there are no evictions.

# %%
n = len(log)
x = list(range(1, n + 1))
colours = {sid: f"C{k}" for k, sid in enumerate(IDS)}
fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH, 5.5), sharex=True)
top.stackplot(
    x,
    [[row["resident"][s] / KiB for row in log] for s in IDS],
    colors=[colours[s] for s in IDS],
    labels=IDS,
    step="mid",
)
top.axhline(BUDGET / KiB, color="k", lw=1, ls="--", label="budget")
top.set(ylabel="resident KiB", title="resident bytes per session (stacked)")
for s in IDS:
    bottom.step(x, [row["parked"][s] / KiB for row in log], where="mid", color=colours[s])
for i, row in enumerate(log, start=1):
    for s in row["parks"]:
        bottom.plot(i, row["parked"][s] / KiB, "v", color=colours[s], ms=6)
    for s in row["unparks"]:
        bottom.plot(i, 0, "^", color=colours[s], ms=6)
bottom.set(xlabel="request", ylabel="parked KiB (disk)", title="parked bytes per session")
top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
fig.tight_layout()
show(fig)

# %% [markdown]
# ## What this notebook shows, checked

# %%
total = {s: SIZE[s] for s in IDS}
for row in log:
    # The budget holds after every request; no session was lost to it.
    assert row["nbytes_cpu"] <= BUDGET
    assert sum(row["resident"].values()) == row["nbytes_cpu"]
    # Every session is whole in exactly one place: resident or parked, never both, never neither.
    for s in row["resident"]:
        if row["resident"][s] or row["parked"][s]:
            assert (row["resident"][s] == 0) != (row["parked"][s] == 0)
            assert row["resident"][s] + row["parked"][s] == total[s]
    assert sum(row["parked"].values()) == row["nbytes_parked_disk"]
    # The session just served is resident.
    assert row["resident"][row["request"]] == total[row["request"]]
assert stats["evictions"] == 0
assert stats["sessions"] == SESSIONS
assert stats["parks"] == sum(len(row["parks"]) for row in log) > 0
assert stats["unparks"] == sum(len(row["unparks"]) for row in log) > 0
# A parked session reads back every bit.
for s in IDS:
    cache = manager.require(s).object("cache").view()[0]
    assert torch.equal(cache, torch.full((SIZE[s] // 4,), float(ROUNDS)))
print("all checks passed")
