"""Write the golden snapshot files of one library version, and build what they must load as.

Run only to add a new version's files; never regenerate existing ones::

    python tests/data/make_golden.py tests/data/snapshots/<library version> [BUILDER ...]
    python tests/data/make_golden.py --digests    # pin the bits of files not yet pinned

Each file is named ``<builder>_v<format version>.safetensors``; a file that exists is never
written again (a new format version of the same library version gets files of its own).

A golden file is a snapshot written by the library at that version.
`tests/storage/test_golden_snapshots.py` loads every committed one with today's code and compares
it with what the builders below build today, so a change to the format or to a class's stored
name fails a test instead of breaking users' saved sessions. The builders are therefore frozen:
change one and the files written from it no longer match. Add a new builder (and new files)
instead.

Each builder returns ``(record, metadata)``; the two model builders (one `model_session` over
the model registry) also store in the metadata what rebuilds their pipeline (the config fields)
and how far the session ran.

The model builders run seeded networks, whose float results depend on the CPU's kernels (an
AMX machine rounds some matmuls and convolutions differently from an AVX2 one, whatever the
environment asks for). So each file's loaded bits are also pinned, leaf by leaf, in
``snapshots/digests.json`` (`digest`, by ``--digests``), once, from the file: the test
compares every file against its pins on any machine, and against what its builder builds
today where that is machine-independent. The files of ``0.1.0.dev0`` were pinned after they
were written, by the loader of the day, which had loaded each of them `tree_equal` to its
builder's record on the machines that wrote them (CI, through the golden tests).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The CPU kernels the files are written with, and that `tests/conftest.py` sets for every test
# run: float results of the model builders depend on them (set before torch is imported).
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import attrs
import torch

import sessionstate as ss
from sessionstate._storage import FORMAT_VERSION
from sessionstate.models._registry import get_model

DZ_STEPS = 2
"""DreamZero steps run before the snapshot: the second leaves a half-filled VAE body chunk."""

COSMOS3_STEPS = 3
"""Cosmos3 steps run before the snapshot, over one session."""


def plain_session() -> tuple[ss.SessionState, dict[str, str]]:
    """A format-1 session: a ring, an accumulating buffer, aliased views, every JSON kind."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 6, generator=g)
    ring = ss.LatentBuffer(dim=0).allocate(maxlen=2)
    for i in range(3):
        ring = ring.commit(base[i : i + 1])
    history = ss.LatentBuffer(dim=1).allocate()
    history = history.commit(torch.arange(6, dtype=torch.int64).view(2, 3))
    state = ss.SessionState(
        objects={"ring": ring, "history": history},
        attrs={
            "base": base,
            "tail": base[2:].t(),  # a strided view sharing the base's storage
            "mask": torch.tensor([True, False, True]),
            "half": torch.linspace(-1, 1, 5).to(torch.bfloat16),
            "step": 7,
            "scale": 0.5,
            "nan": float("nan"),
            "prompt": "pick up the block",
            "done": False,
            "missing": None,
            "shape": (2, 3),
            "tags": ["a", "b"],
        },
    )
    return state, {"builder": "plain_session"}


def kv_session() -> tuple[ss.SessionState, dict[str, str]]:
    """A format-2 session: two `KVHandle`s of one pool sharing their first blocks."""
    g = torch.Generator().manual_seed(2)
    pool = ss.KVPool(8, block_tokens=4, token_shape=(2, 3), dtype=torch.bfloat16, name="kv")
    prefix = pool.append(pool.empty(), torch.randn(8, 2, 3, generator=g).to(torch.bfloat16))
    left = pool.append(prefix, torch.randn(3, 2, 3, generator=g).to(torch.bfloat16))
    right = pool.append(prefix, torch.randn(5, 2, 3, generator=g).to(torch.bfloat16))
    state = ss.SessionState(attrs={"left": left, "right": right, "step": 3})
    return state, {"builder": "kv_session"}


def family_sessions() -> tuple[list[ss.SessionState], dict[str, str]]:
    """A family of forks as `snapshot_many` writes it: a source and three branches (a list).

    The source holds a history (`LatentBuffer`), a cache and a `KVCache` whose last block is
    partial; each branch, forked by the manager, stepped once: a chunk of its own, a new
    cache, and one token (the pool copies the partial block per branch). What they share is
    written once.
    """
    g = torch.Generator().manual_seed(4)
    pool = ss.KVPool(8, block_tokens=4, token_shape=(2,), name="kv")
    history = ss.LatentBuffer(name="history", dim=0).allocate()
    for _ in range(3):
        history = history.commit(torch.randn(2, 3, generator=g))
    source = ss.SessionState(
        objects={
            "history": history,
            "cache": ss.TensorCache(name="cache").allocate().commit(torch.randn(5, generator=g)),
            "kv": ss.KVCache(name="kv")
            .allocate()
            .commit(pool.append(pool.empty(), torch.randn(6, 2, generator=g))),
        },
        attrs={"step": 3},
    )
    manager: ss.SessionStateManager[ss.SessionState] = ss.SessionStateManager()
    manager.put("source", source)
    ids = ["source", "b0", "b1", "b2"]
    manager.fork("source", *ids[1:])
    for branch in ids[1:]:
        state = manager.require(branch)
        grown = pool.append(state.object("kv", ss.KVCache).view(), torch.randn(1, 2, generator=g))
        state = state.with_values(
            {
                "history": state.object("history", ss.LatentBuffer).commit(
                    torch.randn(2, 3, generator=g)
                ),
                "cache": state.object("cache", ss.TensorCache).commit(torch.randn(5, generator=g)),
                "kv": state.object("kv", ss.KVCache).commit(grown),
            },
            step=4,
        )
        manager.put(branch, state)
    records = [manager.require(sid) for sid in ids]
    return records, {"builder": "family_sessions", "session_ids": json.dumps(ids)}


def dreamzero_observations(cfg: Any, n: int) -> list[Any]:
    """``n`` seeded DreamZero observations (frozen here, apart from the test helpers)."""
    from sessionstate.models.dreamzero import CAMERAS, Observation

    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        shape = (cfg.camera_height, cfg.camera_width, 3)
        images = {
            cam: torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) for cam in CAMERAS
        }
        state = torch.randn(cfg.action_dim, generator=g)
        out.append(Observation(images=images, prompt="pick up the block", state=state))
    return out


def cosmos3_requests(cfg: Any, n: int) -> list[Any]:
    """``n`` seeded Cosmos3 requests: a drifting control, a prompt change at step 3."""
    from sessionstate.models.cosmos3 import Cosmos3Request

    g = torch.Generator().manual_seed(3)
    control = torch.randn(cfg.control_dim, generator=g)
    out = []
    for step in range(n):
        control = control + 0.1 * torch.randn(cfg.control_dim, generator=g)
        prompt = "a red cube on a table" if step < 2 else "the cube rolls to the left"
        out.append(Cosmos3Request(prompt=prompt, control=control.clone(), negative_prompt="blurry"))
    return out


MODEL_INPUTS: dict[str, tuple[Callable[[Any, int], list[Any]], int]] = {
    "dreamzero": (dreamzero_observations, DZ_STEPS),
    "cosmos3": (cosmos3_requests, COSMOS3_STEPS),
}
"""Model name (in `sessionstate.models.MODELS`) -> its seeded inputs and the steps run before
the snapshot. The two model builders are one builder over this table and the model registry."""


def _config_text(cfg: Any, fields: dict[str, Any] | None) -> str:
    # The config a file stores: every field of the day it was written. Rebuilt from a file,
    # the fields it stores (a field added since, at its default, is not one of them).
    return json.dumps(fields if fields is not None else attrs.asdict(cfg))


def model_config(model: str, fields: dict[str, Any] | None = None) -> Any:
    """The config of a model's golden session: the tiny preset, or the stored fields."""
    tiny = get_model(model).config_from_dict({"preset": "tiny"})
    return type(tiny)(**fields) if fields is not None else tiny


def model_run(
    model: str, fields: dict[str, Any] | None = None, steps: int | None = None
) -> tuple[Any, list[Any]]:
    """A managed pipeline of ``model`` after ``steps`` steps (all of the golden session's by
    default) of session ``"s"``, and the inputs of the golden session's steps and one more."""
    make_inputs, golden_steps = MODEL_INPUTS[model]
    cfg = model_config(model, fields)
    pipe = get_model(model).pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    inputs = make_inputs(cfg, golden_steps + 1)
    for x in inputs[: golden_steps if steps is None else steps]:
        pipe.forward(x, "s")
    return pipe, inputs


def model_session(
    model: str, fields: dict[str, Any] | None = None, *, keyed: bool = True
) -> tuple[ss.SessionState, dict[str, str]]:
    """A session of ``model`` after its golden steps, managed; with ``keyed=False``, as a file
    written before sessions held a random key loads today (`as_written`)."""
    pipe, _ = model_run(model, fields)
    meta = {
        "builder": f"{model}_session",
        "config": _config_text(pipe.cfg, fields),
        "steps": str(MODEL_INPUTS[model][1]),
    }
    record = pipe.manager.peek("s")
    return (record if keyed else as_written(model, record)), meta


MODEL_OF = {
    "dreamzero": "dreamzero",
    "cosmos3": "cosmos3",
    "dreamzero_keyed": "dreamzero",
    "cosmos3_keyed": "cosmos3",
}
"""Builders that run seeded networks (what they build today depends on the CPU's kernels),
and the model each runs."""

MODEL_BUILDERS = frozenset(MODEL_OF)

BEFORE_KEY = frozenset({"dreamzero", "cosmos3"})
"""Model builders whose files were written before sessions held a random key (every model file
of ``0.1.0.dev0`` up to format 4 but the ``_keyed`` ones): their noise came from the config's
seed alone (DreamZero: the same every step; Cosmos3: the seed and the chunk index). Such a
file loads with a `RandomKey` not allocated (the session classes' upgrade), which the next
step seeds from the config's ``seed``."""


def as_written(builder: str, record: ss.SessionState) -> ss.SessionState:
    """``record`` as a file of ``builder`` loads: for a file written before sessions held a
    random key, with the key the upgrade gives it (not allocated); else ``record``."""
    if builder not in BEFORE_KEY:
        return record
    return record.with_object("random_key", ss.RandomKey(name="random_key"))


DIGESTS = Path(__file__).with_name("snapshots") / "digests.json"
"""``"<library version>/<file stem>"`` -> `digest` of the file's loaded record, pinned once."""


def digest(record: Any) -> list[list[Any]]:
    """Each leaf of ``record`` in tree order: its key path, kind, and what it holds.

    A tensor as its dtype, shape and the SHA-256 of its bytes (in index order); a `KVHandle`
    as its tokens, read, the same way; any other leaf as its repr.
    """
    keys, leaves, _ = ss.tree_flatten_with_keys(record)
    out: list[list[Any]] = []
    for key, leaf in zip(keys, leaves, strict=True):
        if isinstance(leaf, ss.KVHandle):
            out.append([key, "kv", *_tensor_digest(leaf.read())])
        elif isinstance(leaf, torch.Tensor):
            out.append([key, "tensor", *_tensor_digest(leaf)])
        else:
            out.append([key, type(leaf).__name__, repr(leaf)])
    return out


def _tensor_digest(t: torch.Tensor) -> list[Any]:
    data = t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
    return [str(t.dtype), list(t.shape), hashlib.sha256(data.numpy().tobytes()).hexdigest()]


def write_digests(root: Path) -> None:
    """Pin the bits of every golden file under ``root`` not pinned yet; never change a pin."""
    pinned = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    for path in sorted(root.glob("*/*.safetensors")):
        name = f"{path.parent.name}/{path.stem}"
        if name not in pinned:
            pinned[name] = digest(ss.load_state(path))
            print(f"pinned {name}")
    names = sorted(pinned)
    parts = []
    for name in names:  # a leaf a line, so a diff names the leaf
        leaves = ",\n".join(f"  {json.dumps(leaf)}" for leaf in pinned[name])
        parts.append(f" {json.dumps(name)}: [\n{leaves}\n ]")
    DIGESTS.write_text("{\n" + ",\n".join(parts) + "\n}\n")


BUILDERS = {
    "plain": plain_session,
    "kv": kv_session,
    "family": family_sessions,
    "dreamzero": functools.partial(model_session, "dreamzero", keyed=False),
    "cosmos3": functools.partial(model_session, "cosmos3", keyed=False),
    # The same sessions since they hold their random key (`RandomKey`, split on fork).
    "dreamzero_keyed": functools.partial(model_session, "dreamzero"),
    "cosmos3_keyed": functools.partial(model_session, "cosmos3"),
}
"""Builder name (the stem of its files, before ``_v<format version>``) -> builder."""


def main(outdir: Path, names: list[str]) -> None:
    """Write a file per builder (or those named) into ``outdir``; never overwrite one."""
    outdir.mkdir(parents=True, exist_ok=True)
    for name in names or list(BUILDERS):
        build = BUILDERS[name]
        path = outdir / f"{name}_v{FORMAT_VERSION}.safetensors"
        if path.exists():
            msg = f"{path} exists; golden files are never regenerated. Write a new version's."
            raise SystemExit(msg)
        state, meta = build()
        ss.save_state(state, path, metadata=meta)
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--digests"]:
        write_digests(DIGESTS.parent)
    else:
        main(Path(sys.argv[1]), sys.argv[2:])
