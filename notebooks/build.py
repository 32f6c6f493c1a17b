"""Write the notebooks from the cell sources below, execute them, and store their outputs.

    .venv/bin/python notebooks/build.py            # write + execute all three
    .venv/bin/python notebooks/build.py --no-execute

This file is the notebooks' source: edit the cells here, not in Jupyter, and rebuild.
Executing also writes ``docs/img/state_evolution.png`` (the README's plot) from notebook 01,
through ``SESSIONSTATE_FIGURES``; a plain run of a notebook (CI, Jupyter) writes no file.
`tests/test_notebooks.py` re-executes the committed notebooks and checks that their cells
still match this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}

Cell = tuple[str, str]


def md(text: str) -> Cell:
    return ("markdown", textwrap.dedent(text).strip())


def code(text: str) -> Cell:
    return ("code", textwrap.dedent(text).strip())


# Shared by every notebook: Agg backend, small PNGs, one thread.
SETUP = code(
    '''
    import io
    import os
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from IPython.display import Image, display

    import sessionstate as ss

    # Tiny tensors: one thread is fastest, and steady on a busy CI runner.
    torch.set_num_threads(1)
    # diffusers imports tqdm.auto, which warns that ipywidgets is missing; no bar is shown here.
    warnings.filterwarnings("ignore", message="IProgress not found")
    KiB, MiB, GiB = 1024, 1024**2, 1024**3


    def show(fig, name=None):
        """Display ``fig`` as a small PNG; also save it as ``name`` when building the docs."""
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=60, bbox_inches="tight")
        figures = os.environ.get("SESSIONSTATE_FIGURES")
        if name and figures:
            fig.savefig(os.path.join(figures, name), dpi=110, bbox_inches="tight")
        plt.close(fig)
        display(Image(buf.getvalue()))
    '''
)

# ---------------------------------------------------------------------------------------------
# 01: one DreamZero session, step by step, on both paths.
# ---------------------------------------------------------------------------------------------

NB01: list[Cell] = [
    md(
        """
        # 01: a DreamZero session, step by step

        One DreamZero session (the `tiny` preset, CPU) runs for 60 steps on both session-state
        paths:

        - **managed**: the pure `step(state, obs) -> (state, out)`; we thread the immutable
          `DreamZeroSession` record ourselves and keep every version;
        - **bespoke**: the hand-rolled mutable state, updated in place by `forward`.

        After each step we count the bytes of every value, and of each bucket (state objects,
        attributes), with `ss.nbytes_by_device`. The prompt changes at step 40 (a session
        reset), and the local attention window (21 latent frames here) rolls over every 10
        steps (a window reset).
        """
    ),
    SETUP,
    code(
        """
        from sessionstate.models.dreamzero import BUCKETS, DreamZeroConfig, DreamZeroPipeline
        from sessionstate.models.dreamzero.episode import scripted_episode

        STEPS = 60
        cfg = DreamZeroConfig.preset("tiny", local_attn_size=21)
        episode = list(
            scripted_episode(cfg, steps=STEPS, sessions=1, seed=0, prompt_change_every=40)
        )
        managed = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1"})
        bespoke = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "0"})
        managed.managed, bespoke.managed
        """
    ),
    code(
        '''
        def value_bytes(values):
            """Bytes of each value on its own."""
            return {name: sum(ss.nbytes_by_device(v).values()) for name, v in values.items()}


        def bucket_bytes(values):
            """Bytes of each bucket, each storage once."""
            return {
                bucket: sum(
                    ss.nbytes_by_device([v for n, v in values.items() if BUCKETS[n] == bucket])
                    .values()
                )
                for bucket in ("object", "attrs")
            }


        state = managed.new_session()
        records = []  # every version of the managed session
        log = []
        chunk_number = {}  # id(encoder output chunk) -> (number, chunk): numbers in encode order
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
                    "history_frames": b_values["vae_encoder_out"].shape[2],
                    "encoded": len(chunk_number),
                }
            )
        steps = range(1, STEPS + 1)
        session_resets = [i + 1 for i, row in enumerate(log) if row["reset"] == "session"]
        window_resets = [i + 1 for i, row in enumerate(log) if row["reset"] == "inference"]
        print("session resets at steps", session_resets)
        print("window resets at steps ", window_resets)
        print("outputs bit-identical at every step:", all(row["identical"] for row in log))
        '''
    ),
    md(
        """
        ## The encoder output: a ring against the whole history

        `vae_encoder_out` is the only value whose bytes differ between the paths. The bespoke
        path concatenates every encoded latent frame (one every four steps) and keeps it until
        the session resets; a window reset keeps it. The managed path keeps a ring of
        `num_frame_per_block` = 2 frames. The outputs above are bit-identical all the same
        (see the docs' bit-identity notes).
        """
    ),
    code(
        """
        def mark_resets(ax):
            for s in window_resets:
                ax.axvline(s, color="0.75", ls=":", lw=1)
            for s in session_resets:
                ax.axvline(s, color="0.3", lw=1)


        fig, ax = plt.subplots(figsize=(6, 3))
        mark_resets(ax)
        for path, style in (("bespoke", "C3"), ("managed", "C0")):
            ax.plot(
                steps, [row[path]["vae_encoder_out"] / KiB for row in log], style, lw=2,
                label=f"{path}: " + ("whole history" if path == "bespoke" else "ring of 2"),
            )
        ax.set(
            xlabel="step (solid: session reset, dotted: window reset)", ylabel="KiB",
            title="vae_encoder_out bytes, one DreamZero session (tiny)",
        )
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left")
        show(fig, "state_evolution.png")
        """
    ),
    md(
        """
        ## Every value, on both paths

        Bytes per value (log scale). Everything but `vae_encoder_out` is the same on both paths:
        the causal-conv cache is constant once the first body chunk is encoded, the video
        latents grow (they are the session's output) until the session resets, the frames ring
        fills to 4, and the window conditioning is replaced at every window reset.
        """
    ),
    code(
        """
        names = [n for n in BUCKETS if any(row["managed"][n] or row["bespoke"][n] for row in log)]
        fig, axes = plt.subplots(1, 2, figsize=(6, 3), sharey=True)
        for ax, path in zip(axes, ("managed", "bespoke"), strict=True):
            mark_resets(ax)
            for i, name in enumerate(names):
                # Zero bytes (an empty value) break the line rather than drop off the log axis.
                y = [row[path][name] or float("nan") for row in log]
                ax.plot(steps, y, f"C{i}", label=name, lw=1)
            ax.set(title=path, xlabel="step", yscale="log")
        axes[0].set_ylabel("bytes")
        axes[1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        show(fig)
        """
    ),
    code(
        """
        last = log[-1]
        print(f"{'value':26} {'bucket':7} {'managed':>10} {'bespoke':>10}   after {STEPS} steps")
        for name in BUCKETS:
            print(
                f"{name:26} {BUCKETS[name]:7} {last['managed'][name]:>10,} "
                f"{last['bespoke'][name]:>10,}"
            )
        """
    ),
    md(
        """
        ## Per bucket

        The same bytes, by bucket, each storage counted once per bucket. The state objects
        differ between the paths by the encoder output alone. The attributes are the same on
        both, and dominated, at this geometry as at the deploy one, by the Wan encoder's
        causal-conv cache `vae_enc_feat_map`: an attribute, because nothing the manager could
        do to it is useful, whatever its size.
        """
    ),
    code(
        """
        fig, axes = plt.subplots(1, 2, figsize=(6, 3))
        for ax, bucket, title in zip(
            axes, ("object", "attrs"), ("state objects", "attrs"), strict=True
        ):
            mark_resets(ax)
            for path, style in (("bespoke", "C3-"), ("managed", "C0--")):
                ax.plot(steps, [row[f"{path}_buckets"][bucket] / KiB for row in log], style,
                        label=path)
            ax.set(title=title, xlabel="step", ylim=(0, None))
        axes[0].set_ylabel("KiB")
        axes[0].legend(loc="upper left", fontsize=7)
        fig.tight_layout()
        show(fig)
        """
    ),
    md(
        """
        ## What the ring holds

        Each encoded latent frame gets a number, in encode order. At every step the managed
        ring holds the two newest (dots); the bespoke history holds every frame since the
        session began (the bar). Both are reset by the session reset at step 40, and neither
        by a window reset.
        """
    ),
    code(
        """
        fig, ax = plt.subplots(figsize=(6, 3))
        mark_resets(ax)
        for s, row in zip(steps, log, strict=True):
            ax.vlines(s, row["encoded"] - row["history_frames"], row["encoded"] - 1,
                      color="C3", lw=3, alpha=0.35)
            ax.plot([s] * len(row["ring"]), row["ring"], "o", color="C0", ms=3)
        ax.plot([], [], color="C3", lw=3, alpha=0.35, label="bespoke history")
        ax.plot([], [], "o", color="C0", ms=3, label="managed ring")
        ax.set(xlabel="step", ylabel="encoded latent frame #",
               title="vae_encoder_out contents")
        ax.legend(loc="upper left", fontsize=7)
        show(fig)
        """
    ),
    md(
        """
        ## Structural sharing

        We kept all 60 versions of the managed session. A commit stores a reference to the new
        chunk next to references to the chunks already held, so consecutive versions share
        every chunk but the newest, and all 60 versions together hold far less than 60 copies
        would. What they do not share is the attribute replaced wholesale at every body chunk,
        `vae_enc_feat_map`: each replacement is a new cache, so most of what the 60 versions
        hold together is the 15 or so caches the session went through. None of the versions
        changed after it was made.
        """
    ),
    code(
        '''
        import itertools

        together = sum(ss.nbytes_by_device(records).values())
        separately = sum(sum(ss.nbytes_by_device(r).values()) for r in records)
        caches = sum(ss.nbytes_by_device([r.vae_enc_feat_map for r in records]).values())
        n_caches = len({id(r.vae_enc_feat_map) for r in records})
        latest = sum(ss.nbytes_by_device(records[-1]).values())
        print(f"latest version:             {latest:>11,} B")
        print(f"all 60 versions, together:  {together:>11,} B")
        print(f"  of which {n_caches} feature caches: {caches:>11,} B")
        print(f"all 60 versions, as copies: {separately:>11,} B")


        def shares_all_but_newest(prev, cur):
            """Every chunk ``cur`` holds, but the one it just committed, is one ``prev`` held."""
            return all(any(c is p for p in prev.view()) for c in cur.view()[:-1])


        buffers = ("stitched_buffer", "video_latents_across_time", "vae_encoder_out")
        shared = all(
            shares_all_but_newest(prev.object(name), cur.object(name))
            for prev, cur in itertools.pairwise(records)
            for name in buffers
        )
        print("consecutive versions share every chunk but the newest:", shared)
        '''
    ),
    md("## What this notebook shows, checked"),
    code(
        """
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
            row["managed"][n] == row["bespoke"][n]
            for row in log for n in BUCKETS if n != "vae_encoder_out"
        )
        # The ring holds the two newest encoded frames; the history all since the session began.
        for row in log:
            assert row["ring"] == list(range(row["encoded"] - len(row["ring"]), row["encoded"]))
        # Sharing: a commit copies nothing, 60 versions cost far less than 60 copies, and
        # what they do not share is the replaced-wholesale feature cache.
        assert shared
        assert together < separately / 3
        assert caches > together / 2
        assert all(
            value_bytes(r.values()) == row["managed"] for r, row in zip(records, log, strict=True)
        )
        print("all checks passed")
        """
    ),
]

# ---------------------------------------------------------------------------------------------
# 02: the manager over a multi-session workload.
# ---------------------------------------------------------------------------------------------

NB02: list[Cell] = [
    md(
        """
        # 02: the manager, many sessions, a small cap

        Eight sessions share a `SessionStateManager` capped at four. Requests arrive in a
        seeded, skewed order (session `s0` is the busiest), each one a `get_or_create`, a pure
        `step`, and a `put`. Next to the manager runs an obviously correct model, an
        `OrderedDict` LRU, and we check after every request that they agree.

        Each session is the README's: a ring of the last two input chunks and a step counter.
        Session `sK` sends chunks of `64 * (K + 1)` floats, so sessions differ in size.
        """
    ),
    SETUP,
    code(
        '''
        import random
        from collections import OrderedDict

        CAP, SESSIONS, REQUESTS = 4, 8, 80
        IDS = [f"s{k}" for k in range(SESSIONS)]
        WIDTH = {sid: 64 * (k + 1) for k, sid in enumerate(IDS)}


        class Session(ss.SessionState):
            steps = ss.SessionAttr(0, coerce=int, doc="Completed steps.")


        def new_session():
            ring = ss.LatentBuffer(name="latents", dim=0).allocate(maxlen=2)
            return Session(objects={"latents": ring})


        def step(state, x):
            """Pure: returns the next state and the output; ``state`` is left unchanged."""
            state = state.update_object("latents", lambda ring: ring.commit(x))
            out = state.object("latents").concat().mean(dim=0)
            return state.with_attrs(steps=state.steps + 1), out


        rng = random.Random(0)
        requests = rng.choices(IDS, weights=[(k + 1) ** -1.5 for k in range(SESSIONS)], k=REQUESTS)
        print(" ".join(requests[:24]), "...")
        '''
    ),
    code(
        """
        manager = ss.SessionStateManager(max_sessions=CAP)
        model = OrderedDict()  # session id -> steps held, least recently used first
        counts = {"hits": 0, "misses": 0, "evictions": 0}
        timeline = []
        for i, sid in enumerate(requests):
            before = manager.session_ids()
            state = manager.get_or_create(sid, new_session)
            state, out = step(state, torch.full((1, WIDTH[sid]), float(i)))
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
            model_bytes = sum(min(n, 2) * WIDTH[s] * 4 for s, n in model.items())

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
        """
    ),
    md(
        """
        ## The LRU timeline

        One row per session, one column per request. Shaded: the session is resident (the
        manager holds its latest record). A dot marks the session requested; a red cross, the
        session evicted by that request (the least recently used one, when a new session
        arrives at the cap). An evicted session that comes back starts over, as a miss.
        """
    ),
    code(
        """
        import numpy as np

        resident = np.array([[sid in row["resident"] for row in timeline] for sid in IDS])
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.imshow(resident, aspect="auto", cmap="Blues", vmin=0, vmax=1.6, interpolation="nearest")
        ax.plot(range(REQUESTS), [IDS.index(row["sid"]) for row in timeline], "k.", ms=2)
        evictions = [(i, IDS.index(s)) for i, row in enumerate(timeline) for s in row["evicted"]]
        ax.plot([i for i, _ in evictions], [k for _, k in evictions], "x", color="C3", ms=4)
        ax.set(yticks=range(SESSIONS), yticklabels=IDS, xlabel="request",
               title=f"resident sessions (cap {CAP}); x = eviction")
        show(fig)
        """
    ),
    md(
        """
        ## `stats()` over time

        Hits, misses and evictions accumulate; `sessions` saturates at the cap; `total_nbytes`
        follows which sessions are resident (a session holds at most two chunks of its
        width).
        """
    ),
    code(
        """
        fig, (left, right) = plt.subplots(1, 2, figsize=(6, 3))
        for key in ("hits", "misses", "evictions", "sessions"):
            left.plot([row["stats"][key] for row in timeline], label=key)
        left.set(xlabel="request", title="counters")
        left.legend(fontsize=7)
        right.plot([row["stats"]["total_nbytes"] / KiB for row in timeline], "C4")
        right.set(xlabel="request", ylabel="KiB", title="total_nbytes")
        fig.tight_layout()
        show(fig)
        """
    ),
    md(
        """
        ## Eviction drops a session from the table only

        A caller that still holds an evicted session's record keeps working on it. Putting it
        back admits it as a new session, which evicts the least recently used one.
        """
    ),
    code(
        """
        m = ss.SessionStateManager(max_sessions=2)
        held = m.get_or_create("a", new_session)
        m.put("a", step(held, torch.ones(1, 4))[0])
        held = m.get("a")
        for sid in ("b", "c"):  # two new sessions: "a" is evicted
            m.put(sid, new_session())
        print("resident:", m.session_ids(), "| evictions:", m.stats()["evictions"])
        held, out = step(held, torch.zeros(1, 4))  # the held record still works
        m.put("a", held)
        print("resident:", m.session_ids(), "| evictions:", m.stats()["evictions"],
              "| a.steps =", m.get("a").steps)
        """
    ),
    md(
        """
        ## Shared storages count once

        `stats()` counts every storage once across all sessions; `nbytes_by_session()` counts
        each session on its own. Two sessions holding the same tensor show the difference.
        """
    ),
    code(
        """
        shared = torch.zeros(1024)  # 4 KiB, e.g. a pipeline-wide embedding
        m2 = ss.SessionStateManager()
        for sid in ("x", "y"):
            m2.put(sid, Session(attrs={"steps": 0}).with_object(
                "latents", ss.LatentBuffer(dim=0).allocate().commit(shared[None])))
        per_session = m2.nbytes_by_session()
        print(per_session, "sum:", sum(d["cpu"] for d in per_session.values()),
              "| stats total:", m2.stats()["total_nbytes"])
        """
    ),
    md("## What this notebook shows, checked"),
    code(
        """
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
        assert m.get("a").steps == 2
        # Shared storages: once in the total, once per session in the breakdown.
        assert m2.stats()["total_nbytes"] == 4096
        assert sum(d["cpu"] for d in per_session.values()) == 8192
        print("all checks passed")
        """
    ),
]

# ---------------------------------------------------------------------------------------------
# 03: byte accounting, case by case, and the deploy size table on meta.
# ---------------------------------------------------------------------------------------------

NB03: list[Cell] = [
    md(
        """
        # 03: byte accounting

        What `ss.nbytes_by_device` counts, case by case, next to the naive sum a hand-rolled
        model would use: `numel() * element_size()` over every tensor (and `nbytes` over every
        NumPy array). Then why storages are identified by storage object on the `meta` device,
        and finally the DreamZero size table at the deploy geometry, computed on `meta` without
        allocating a byte.
        """
    ),
    SETUP,
    code(
        '''
        import json
        from pathlib import Path

        import numpy as np


        def library(tree):
            return sum(ss.nbytes_by_device(tree).values())


        def naive(tree):
            """numel * element_size over every tensor leaf; nbytes over every NumPy leaf."""
            total = 0
            for leaf in ss.tree_leaves(tree):
                if isinstance(leaf, torch.Tensor):
                    total += leaf.numel() * leaf.element_size()
                elif isinstance(leaf, np.ndarray):
                    total += leaf.nbytes
            return total


        class Opaque:  # not a pytree node: a leaf, and its tensor is invisible
            def __init__(self, t):
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

        cases = {  # name -> (tree, the bytes it really keeps alive)
            "one tensor": (x, 4096),
            "narrow slice x[:8]": (x[:8], 4096),
            "x[:8].clone()": (x[:8].clone(), 32),
            "4 views of x": ({"a": x, "b": x.view(32, 32), "c": x[10:20], "d": x.detach()}, 4096),
            "expand(1000, 4)": (torch.zeros(4).expand(1000, 4), 16),
            "attr aliases a chunk": (ss.SessionState(objects={"r": ring}, attrs={"a": x[:8]}),
                                     4096),
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
        '''
    ),
    md(
        """
        The library reports what each tree keeps alive: a slice keeps its whole allocation, four
        views of one tensor are one allocation, an expanded tensor owns 16 bytes, a sparse
        tensor owns its indices and values. The last row is the one thing it cannot see: a
        tensor inside an object that is not a pytree node. Make such classes records.
        """
    ),
    code(
        """
        names = list(cases)
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ys = np.arange(len(names))
        ax.barh(ys - 0.2, [max(library(cases[n][0]), 1) for n in names], 0.4, label="library")
        ax.barh(ys + 0.2, [max(naive(cases[n][0]), 1) for n in names], 0.4, label="naive sum")
        ax.set(yticks=ys, yticklabels=names, xscale="log", xlabel="bytes (0 drawn as 1)")
        ax.invert_yaxis()
        ax.legend(fontsize=7)
        show(fig)
        """
    ),
    md(
        """
        ## Storage identity on `meta`

        Every storage on the `meta` device has data pointer 0. Deduplicating by data pointer
        would make all meta tensors one storage; the library identifies a storage without memory
        by its storage object instead.
        """
    ),
    code(
        """
        metas = [torch.empty(256, device="meta") for _ in range(4)]  # 1 KiB each
        by_pointer = {}
        for t in metas:
            by_pointer.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        print("data pointers:", [t.data_ptr() for t in metas])
        print("deduplicated by data pointer:", sum(by_pointer.values()), "bytes")
        print("library:", ss.nbytes_by_device([*metas, metas[0][:10]]))
        """
    ),
    md(
        """
        ## The DreamZero size table, on `meta`

        Two DreamZero pipelines at the deploy geometry (three 180x320 cameras stitched to
        352x640, bfloat16, the Wan 2.1 VAE at its released width) are built on `meta` and run
        one session for 12 steps: every shape is exact and nothing is allocated. Values that
        stop changing after the first body chunk must equal the committed 400-step table that
        the docs render; the two that grow must follow their per-step rate to it.
        """
    ),
    code(
        """
        from sessionstate.models.dreamzero import BUCKETS, DreamZeroConfig, DreamZeroPipeline
        from sessionstate.models.dreamzero.episode import scripted_episode

        STEPS = 12
        deploy = DreamZeroConfig.preset("deploy")
        held = {}
        for flag, path in (("1", "managed"), ("0", "bespoke")):
            pipe = DreamZeroPipeline(deploy, device="meta", host_device="meta",
                                     environ={ss.ENV_ENABLE: flag})
            for sid, obs in scripted_episode(deploy, steps=STEPS, sessions=1, seed=0,
                                             prompt_change_every=STEPS + 1):
                pipe.forward(obs, sid)
            values = pipe.session_values("session-0")
            held[path] = {n: sum(ss.nbytes_by_device(v).values()) for n, v in values.items()}
            if path == "managed":
                feat_map = values["vae_enc_feat_map"]
        print(f"{'value':26} {'managed MiB':>12} {'bespoke MiB':>12}   after {STEPS} steps, meta")
        for name in BUCKETS:
            managed_mib, bespoke_mib = held["managed"][name] / MiB, held["bespoke"][name] / MiB
            print(f"{name:26} {managed_mib:>12.5f} {bespoke_mib:>12.5f}")
        print(f"vae_enc_feat_map: {sum(t is not None for t in feat_map)} tensors")
        """
    ),
    code(
        """
        root = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "pyproject.toml").exists())
        committed = json.loads((root / "docs/data/sizes-deploy-400.json").read_text())
        N = committed["steps"]


        def latent_frames(steps):  # video latents: the reference frame + 2 per step
            return 1 + 2 * steps


        def encoded_frames(steps):  # the seed frame + one body chunk every 4 steps
            return 1 + (steps - 1) // 4


        per_video_frame = held["managed"]["video_latents_across_time"] // latent_frames(STEPS)
        per_encoded_frame = held["bespoke"]["vae_encoder_out"] // encoded_frames(STEPS)
        predicted = {path: dict(held[path]) for path in held}
        for path in predicted:
            predicted[path]["video_latents_across_time"] = per_video_frame * latent_frames(N)
        predicted["bespoke"]["vae_encoder_out"] = per_encoded_frame * encoded_frames(N)

        print(f"{'value':26} {'predicted 400':>14} {'committed 400':>14}   (managed / bespoke)")
        for name in committed["values"]:  # the committed table predates `kv_cache`
            row = committed["values"][name]
            for path in ("managed", "bespoke"):
                print(f"{name if path == 'managed' else '':26} {predicted[path][name]:>14,} "
                      f"{row[path + '_nbytes']:>14,}   {path}")
        """
    ),
    code(
        """
        s = np.arange(1, N + 1)
        fig, ax = plt.subplots(figsize=(6, 3))
        feat_mib = held["managed"]["vae_enc_feat_map"] / MiB
        ax.plot(s, np.full(N, feat_mib), label="vae_enc_feat_map (attr)")
        ax.plot(s, latent_frames(s) * per_video_frame / MiB, label="video_latents_across_time")
        ax.plot(s, encoded_frames(s) * per_encoded_frame / MiB, label="vae_encoder_out, bespoke")
        ax.plot(s, np.minimum(encoded_frames(s), 2) * per_encoded_frame / MiB,
                label="vae_encoder_out, managed ring")
        for name in ("vae_enc_feat_map", "video_latents_across_time", "vae_encoder_out"):
            for path, marker in (("managed", "o"), ("bespoke", "s")):
                nbytes = committed["values"][name][path + "_nbytes"]
                ax.plot(N, nbytes / MiB, marker, color="k", ms=3)
        ax.set(yscale="log", xlabel="step", ylabel="MiB",
               title="one DreamZero session at deploy geometry (black: committed table)")
        ax.legend(fontsize=6)
        show(fig)
        """
    ),
    md("## What this notebook shows, checked"),
    code(
        """
        # Each case counts what it keeps alive; the naive sum is wrong on slices, views,
        # expanded and sparse tensors, and aliases.
        for name, (tree, alive) in cases.items():
            assert library(tree) == alive, name
        assert sum(library(cases[n][0]) != naive(cases[n][0]) for n in cases) >= 6
        # Meta: deduplicating by data pointer sees one storage; the library sees four.
        assert set(by_pointer) == {0}
        assert sum(by_pointer.values()) == 1024
        assert ss.nbytes_by_device(metas) == {"meta": 4096}
        # The deploy geometry on meta: the figures the feature description quotes.
        assert held["managed"]["vae_enc_feat_map"] == 632586240  # bytes
        assert held["managed"]["vae_enc_feat_map"] / MiB == 603.28125
        assert sum(t is not None for t in feat_map) == 24
        assert held["managed"]["vae_encoder_out"] / MiB == 0.4296875  # the ring: 2 frames
        assert per_encoded_frame / MiB == 0.21484375  # the bespoke history, per latent frame
        assert round(64 * held["managed"]["vae_enc_feat_map"] / GiB, 1) == 37.7
        # ... and the committed table the docs render: steady values equal, growing ones on rate.
        for name in committed["values"]:
            for path in ("managed", "bespoke"):
                assert predicted[path][name] == committed["values"][name][path + "_nbytes"], name
        print("all checks passed")
        """
    ),
]

NOTEBOOKS = {
    "01_state_evolution.ipynb": NB01,
    "02_manager.ipynb": NB02,
    "03_accounting.ipynb": NB03,
}


def make(cells: list[Cell]) -> nbformat.NotebookNode:
    """A notebook of ``cells``, without outputs."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNEL)
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, source) in enumerate(cells):
        cell = (nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell)(
            source
        )
        cell.id = f"cell-{i:02d}"  # stable ids keep diffs small
        nb.cells.append(cell)
    return nb


def write_kernelspec(directory: Path) -> Path:
    """Write a ``python3`` kernelspec that runs this interpreter; return ``directory``.

    Put the result first on ``JUPYTER_PATH`` so the notebooks run in this venv's Python even
    where a user-level ``python3`` kernelspec points at another interpreter.
    """
    spec = directory / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": KERNEL["display_name"], "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel), encoding="utf-8")
    return directory


def execute(nb: nbformat.NotebookNode, *, timeout: int = 300) -> None:
    """Execute ``nb`` in place in a python3 kernel, from the notebooks directory."""
    NotebookClient(
        nb,
        kernel_name="python3",
        timeout=timeout,
        record_timing=False,
        resources={"metadata": {"path": str(HERE)}},
    ).execute()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="write the cells only")
    parser.add_argument("names", nargs="*", help="notebooks to build (default: all)")
    args = parser.parse_args(argv)
    os.environ["MPLBACKEND"] = "Agg"
    figures = ROOT / "docs" / "img"
    figures.mkdir(parents=True, exist_ok=True)
    os.environ["SESSIONSTATE_FIGURES"] = str(figures)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["JUPYTER_PATH"] = str(write_kernelspec(Path(tmp)))
        for name in args.names or NOTEBOOKS:
            nb = make(NOTEBOOKS[name])
            if not args.no_execute:
                start = time.perf_counter()
                execute(nb)
                print(f"{name}: executed in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            nbformat.validate(nb)
            nbformat.write(nb, HERE / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
