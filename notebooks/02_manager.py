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
# # 02: the manager, many sessions, a small cap
#
# Eight sessions share a `SessionStateManager` capped at four. Requests arrive in a
# seeded, skewed order (session `s0` is the busiest), each one a `get_or_create`, a pure
# `step`, and a `put`. Next to the manager runs an obviously correct model, an
# `OrderedDict` LRU, and we check after every request that they agree.
#
# Each session is the README's: a ring of the last two input chunks and a step counter.
# Session `sK` sends chunks of `64 * (K + 1)` floats, so sessions differ in size.

# %%
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from nbsetup import WIDTH, KiB, plt, show

import sessionstate as ss

# %%
CAP, SESSIONS, REQUESTS = 4, 8, 80
IDS = [f"s{k}" for k in range(SESSIONS)]
CHUNK = {sid: 64 * (k + 1) for k, sid in enumerate(IDS)}


class Session(ss.SessionState):
    steps = ss.SessionAttr(0, coerce=int, doc="Completed steps.")


def new_session() -> Session:
    ring = ss.LatentBuffer(name="latents", dim=0).allocate(maxlen=2)
    return Session(objects={"latents": ring})


def step(state: Session, x: torch.Tensor) -> tuple[Session, torch.Tensor]:
    """Pure: returns the next state and the output; ``state`` is left unchanged."""
    state = state.update_object("latents", lambda ring: ring.commit(x))
    ring = state.object("latents")
    assert isinstance(ring, ss.LatentBuffer)
    return state.with_attrs(steps=state.steps + 1), ring.concat().mean(dim=0)


def held_session(manager: ss.SessionStateManager, sid: str) -> Session:
    """The session ``manager`` holds for ``sid``."""
    state = manager.get(sid)
    assert isinstance(state, Session)
    return state


rng = random.Random(0)
requests = rng.choices(IDS, weights=[(k + 1) ** -1.5 for k in range(SESSIONS)], k=REQUESTS)
print(" ".join(requests[:24]), "...")

# %%
manager = ss.SessionStateManager(max_sessions=CAP)
model: OrderedDict[str, int] = OrderedDict()  # session id -> steps held, LRU first
counts = {"hits": 0, "misses": 0, "evictions": 0}
timeline: list[dict[str, Any]] = []
for i, sid in enumerate(requests):
    before = manager.session_ids()
    state = manager.get_or_create(sid, new_session)
    assert isinstance(state, Session)
    state, out = step(state, torch.full((1, CHUNK[sid]), float(i)))
    manager.put(sid, state)

    # The model: an OrderedDict LRU.
    if sid in model:
        counts["hits"] += 1
        model.move_to_end(sid)
    else:
        counts["misses"] += 1
        model[sid] = 0
        if len(model) > CAP:
            model.popitem(last=False)
            counts["evictions"] += 1
    model[sid] += 1
    model_bytes = sum(min(n, 2) * CHUNK[s] * 4 for s, n in model.items())

    timeline.append(
        {
            "sid": sid,
            "resident": manager.session_ids(),
            "evicted": sorted(set(before) - set(manager.session_ids())),
            "stats": manager.stats(),
            "model": list(model),
            "model_counts": dict(counts),
            "model_bytes": model_bytes,
        }
    )
manager.stats()

# %% [markdown]
# ## The LRU timeline
#
# One row per session, one column per request. Shaded: the session is resident (the
# manager holds its latest record). A dot marks the session requested; a red cross, the
# session evicted by that request (the least recently used one, when a new session
# arrives at the cap). An evicted session that comes back starts over, as a miss.

# %%
resident = np.array([[sid in row["resident"] for row in timeline] for sid in IDS])
fig, ax = plt.subplots(figsize=(WIDTH, 3.5))
ax.imshow(resident, aspect="auto", cmap="Blues", vmin=0, vmax=1.6, interpolation="nearest")
ax.plot(range(REQUESTS), [IDS.index(row["sid"]) for row in timeline], "k.", ms=2)
evictions = [(i, IDS.index(s)) for i, row in enumerate(timeline) for s in row["evicted"]]
ax.plot([i for i, _ in evictions], [k for _, k in evictions], "x", color="C3", ms=4)
ax.set(
    yticks=range(SESSIONS),
    yticklabels=IDS,
    xlabel="request",
    title=f"resident sessions (cap {CAP}); x = eviction",
)
show(fig)

# %% [markdown]
# ## `stats()` over time
#
# Hits, misses and evictions accumulate; `sessions` saturates at the cap; `total_nbytes`
# follows which sessions are resident (a session holds at most two chunks of its
# width).

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH, 3.5))
for key in ("hits", "misses", "evictions", "sessions"):
    left.plot([row["stats"][key] for row in timeline], label=key)
left.set(xlabel="request", title="counters")
left.legend()
right.plot([row["stats"]["total_nbytes"] / KiB for row in timeline], "C4")
right.set(xlabel="request", ylabel="KiB", title="total_nbytes")
fig.tight_layout()
show(fig)

# %% [markdown]
# ## Eviction drops a session from the table only
#
# A caller that still holds an evicted session's record keeps working on it. Putting it
# back admits it as a new session, which evicts the least recently used one.

# %%
m = ss.SessionStateManager(max_sessions=2)
held = m.get_or_create("a", new_session)
assert isinstance(held, Session)
m.put("a", step(held, torch.ones(1, 4))[0])
held = held_session(m, "a")
for sid in ("b", "c"):  # two new sessions: "a" is evicted
    m.put(sid, new_session())
print("resident:", m.session_ids(), "| evictions:", m.stats()["evictions"])
held, out = step(held, torch.zeros(1, 4))  # the held record still works
m.put("a", held)
print(
    "resident:",
    m.session_ids(),
    "| evictions:",
    m.stats()["evictions"],
    "| a.steps =",
    held_session(m, "a").steps,
)

# %% [markdown]
# ## Shared storages count once
#
# `stats()` counts every storage once across all sessions; `nbytes_by_session()` counts
# each session on its own. Two sessions holding the same tensor show the difference.

# %%
shared = torch.zeros(1024)  # 4 KiB, e.g. a pipeline-wide embedding
m2 = ss.SessionStateManager()
for sid in ("x", "y"):
    m2.put(
        sid,
        Session(attrs={"steps": 0}).with_object(
            "latents", ss.LatentBuffer(dim=0).allocate().commit(shared[None])
        ),
    )
per_session = m2.nbytes_by_session()
print(
    per_session,
    "sum:",
    sum(d["cpu"] for d in per_session.values()),
    "| stats total:",
    m2.stats()["total_nbytes"],
)

# %% [markdown]
# ## What this notebook shows, checked

# %%
final = timeline[-1]["stats"]
for row in timeline:
    # The manager's table is the model's, in LRU order, after every request.
    assert row["resident"] == row["model"]
    assert len(row["resident"]) <= CAP
    # Its counters are the model's.
    assert {k: row["stats"][k] for k in counts} == row["model_counts"]
    # Its bytes are the model's: each resident session, two chunks at most.
    assert row["stats"]["total_nbytes"] == row["stats"]["nbytes:cpu"] == row["model_bytes"]
# The workload did exercise the cap.
assert final["evictions"] == counts["evictions"] > 0
assert final["sessions"] == CAP
assert final["hits"] + final["misses"] == REQUESTS
# A held record outlives its eviction; putting it back evicts someone else.
assert m.session_ids() == ["c", "a"]
assert held_session(m, "a").steps == 2
# Shared storages: once in the total, once per session in the breakdown.
assert m2.stats()["total_nbytes"] == 4096
assert sum(d["cpu"] for d in per_session.values()) == 8192
print("all checks passed")
