"""The size tables' fast path: replayed network calls on meta lay out every value as the full run.

`MetaReplay` against the function it replays, on calls built to hit each of its cases; then
both models, both paths, the replayed run (and DreamZero's meta images) against the full one,
every value's layout compared after every step; then the tables themselves.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import pytest
import torch

from sessionstate import nbytes_by_device
from sessionstate._env import ENV_ENABLE
from sessionstate._tree import tree_flatten_with_keys
from sessionstate.cli._sizes import size_table as cli_size_table
from sessionstate.models._sizes import MetaReplay, replay_on_meta, size_run
from tests.support import ROOT


def layout(tree: Any) -> list[tuple[Any, ...]]:
    """Every leaf of ``tree`` as a byte count sees it: where it is, its view, its storage.

    Storages are numbered by first appearance, so two trees compare equal only if the same
    leaves share storage. Host tensors carry their values; other leaves their bytes.
    """
    keys, leaves, _ = tree_flatten_with_keys(tree)
    ordinal: dict[int, int] = {}
    rows: list[tuple[Any, ...]] = []
    for key, leaf in zip(keys, leaves, strict=True):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            row: tuple[Any, ...] = (
                key,
                str(leaf.device),
                leaf.dtype,
                tuple(leaf.shape),
                leaf.stride(),
                leaf.storage_offset(),
                storage.nbytes(),
                ordinal.setdefault(storage._cdata, len(ordinal)),
            )
            if leaf.device.type != "meta":
                row += (leaf.tolist(),)
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            row = (key, leaf)
        else:
            row = (key, type(leaf).__qualname__, nbytes_by_device(leaf))
        rows.append(row)
    return rows


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


# -- MetaReplay against the function it replays ------------------------------------------------

# Each case: a pure function, and a maker of its arguments (called afresh for every call).
CASES: dict[str, tuple[Callable[..., Any], Callable[[], tuple[Any, ...]]]] = {
    "fresh result": (lambda x: torch.cat([x, x]), lambda: (meta(2, 3),)),
    "view of an argument": (lambda x: x[:, 1:], lambda: (meta(4, 6)[1:],)),
    "argument handed back, None, a copy": (
        lambda x: (x, None, x.t().contiguous()),
        lambda: (meta(2, 5),),
    ),
    "two results sharing a storage": (
        lambda x: (lambda y: (y, y[0]))(x * 2),
        lambda: (meta(3, 4),),
    ),
    "arguments sharing a storage": (
        lambda x, y: torch.stack([x, y]),
        lambda: (lambda b: (b[0], b[1]))(meta(2, 7)),
    ),
    "a plain argument": (lambda x, n: x.repeat(n, 1), lambda: (meta(1, 3), 4)),
    "a pytree of arguments": (
        lambda d: tuple(None if t is None else t.sum(0) for t in d["kv"]),
        lambda: ({"kv": (meta(5, 2), None, meta(5, 3))},),
    ),
    "a bfloat16 view": (
        lambda x: x.to(torch.bfloat16).view(-1)[2:],
        lambda: (meta(4, 4),),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_replayed_call_lays_out_its_result_as_the_function_does(name: str) -> None:
    fn, make = CASES[name]
    replay = MetaReplay(fn)
    first = make()
    assert layout((first, replay(*first))) == layout((first, fn(*first)))
    for _ in range(3):
        args = make()
        assert layout((args, replay(*args))) == layout((args, fn(*args)))
    assert (replay.calls, replay.runs) == (4, 1)


def test_a_result_that_views_its_argument_is_replayed_only_for_the_same_view() -> None:
    # Same shape and strides, another offset: the view starts elsewhere, so the call runs.
    fn = lambda x: x[1:]  # noqa: E731 - a one-line pure function under test
    replay = MetaReplay(fn)
    calls = [(meta(10, 3)[2:6],), (meta(10, 3)[4:8],), (meta(10, 3)[4:8],)]
    for args in calls:
        assert layout((args, replay(*args))) == layout((args, fn(*args)))
    assert (replay.calls, replay.runs) == (3, 2)


def test_a_fresh_result_is_replayed_for_any_offset_and_storage_size() -> None:
    fn = lambda x: x * 2  # noqa: E731 - a one-line pure function under test
    replay = MetaReplay(fn)
    calls = [(meta(10, 3)[2:6],), (meta(4, 3),), (meta(50, 3)[40:44],)]
    for args in calls:
        assert layout((args, replay(*args))) == layout((args, fn(*args)))
    assert (replay.calls, replay.runs) == (3, 1)


def test_another_layout_runs_the_function() -> None:
    fn = lambda x: x.sum(0)  # noqa: E731 - a one-line pure function under test
    replay = MetaReplay(fn)
    calls = [(meta(3, 4),), (meta(3, 5),), (meta(4, 3).t(),), (meta(3, 4).to(torch.float16),)]
    for args in calls:
        assert layout((args, replay(*args))) == layout((args, fn(*args)))
    assert (replay.calls, replay.runs) == (4, 4)


def test_host_tensors_are_keyed_by_their_values() -> None:
    fn = lambda n: torch.empty(int(n.sum()), device="meta")  # noqa: E731 - under test
    replay = MetaReplay(fn)
    for values in ([1, 2], [2, 2], [1, 2]):
        n = torch.tensor(values)
        assert layout(replay(n)) == layout(fn(n))
    assert (replay.calls, replay.runs) == (3, 2)


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (lambda x: torch.zeros(x.shape), (meta(2),)),  # a result with values is never replayed
        (lambda x, s: x * len(s), (meta(2), {1, 2})),  # nor a call with an unhashable leaf
        (lambda x: [x.clone(), object()], (meta(2),)),  # nor a result with an object
    ],
)
def test_calls_that_cannot_be_replayed_run_every_time(
    fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    replay = MetaReplay(fn)
    for _ in range(3):
        replay(*args)
    assert (replay.calls, replay.runs) == (3, 3)


def test_replay_on_meta_shadows_the_instance_only() -> None:
    class Nets(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 4, device="meta")

        def twice(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.lin(x) * 2
            return out

    nets, other = Nets(), Nets()
    replays = replay_on_meta(nets, ["twice", "lin.forward"])
    for _ in range(3):
        x = meta(5, 3)
        assert layout(nets.twice(x)) == layout(other.twice(x))
    assert (replays["twice"].calls, replays["twice"].runs) == (3, 1)
    assert (replays["lin.forward"].calls, replays["lin.forward"].runs) == (1, 1)
    assert not isinstance(other.twice, MetaReplay)
    assert not isinstance(other.lin.forward, MetaReplay)


# -- both models, both paths: replayed against full, step by step ------------------------------

Episode = Iterable[tuple[Hashable, Any]]


def _compare_step_by_step(
    build: Callable[[str], Any],
    full_episode: Callable[[], Episode],
    fast_episode: Callable[[], Episode],
    replayed: tuple[str, ...],
) -> dict[str, MetaReplay]:
    """Both paths, as a size table runs them; returns the replays of the managed path."""
    recorded: dict[str, dict[Hashable, Any]] = {}
    replays: dict[str, MetaReplay] = {}
    for flag in ("0", "1"):
        full, fast = build(flag), build(flag)
        replays = replay_on_meta(fast.nets, replayed, recorded)
        steps = zip(full_episode(), fast_episode(), strict=True)
        for step, ((sid, full_in), (fast_sid, fast_in)) in enumerate(steps):
            assert sid == fast_sid
            full.forward(full_in, sid)
            fast.forward(fast_in, sid)
            expected = layout(full.session_values(sid))
            assert layout(fast.session_values(sid)) == expected, f"path {flag}, step {step}"
    return replays


@pytest.mark.parametrize(("preset", "steps"), [("tiny", 40), ("deploy", 9)])
def test_dreamzero_replayed_values_are_laid_out_as_computed_ones(preset: str, steps: int) -> None:
    from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    from sessionstate.models.dreamzero.episode import scripted_episode
    from sessionstate.models.dreamzero.sizes import REPLAYED, meta_episode

    # tiny: 40 steps pass window resets and body chunks many times over; deploy: 9 steps
    # reach the seed, two body chunks and the full KV window.
    cfg = DreamZeroConfig.preset(preset)
    replays = _compare_step_by_step(
        lambda flag: DreamZeroPipeline(
            cfg, device="meta", host_device="meta", environ={ENV_ENABLE: flag}
        ),
        lambda: scripted_episode(
            cfg, steps=steps, sessions=1, seed=0, prompt_change_every=steps + 1
        ),
        lambda: meta_episode(cfg, steps),
        REPLAYED,
    )
    # The managed path ran after the bespoke one had recorded: it computes no denoising.
    assert replays["diffuse"].calls == steps
    assert replays["denoiser.forward"].runs == 0


def test_cosmos3_replayed_values_are_laid_out_as_computed_ones() -> None:
    from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline
    from sessionstate.models.cosmos3.episode import scripted_episode
    from sessionstate.models.cosmos3.sizes import REPLAYED

    cfg = Cosmos3Config.preset("tiny", num_inference_steps=1)
    steps = 12

    def episode() -> Episode:
        # Prompt changes included: they reset the session and its text K/V.
        return scripted_episode(cfg, steps=steps, sessions=1, seed=0, prompt_change_every=5)

    replays = _compare_step_by_step(
        lambda flag: Cosmos3Pipeline(
            cfg, device="meta", host_device="meta", environ={ENV_ENABLE: flag}
        ),
        episode,
        episode,
        REPLAYED,
    )
    assert replays["guided_velocity"].calls == steps
    assert replays["guided_velocity"].runs < steps


# -- the tables --------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "steps"), [("dreamzero", 16), ("cosmos3", 10)])
def test_the_fast_table_is_the_full_table(model: str, steps: int) -> None:
    fast = cli_size_table("tiny", steps, model=model)
    assert cli_size_table("tiny", steps, model=model, full=True) == fast


def test_size_run_full_runs_every_call_of_the_scripted_episode() -> None:
    from sessionstate.models.dreamzero.sizes import size_table

    seen: list[tuple[int, int]] = []
    with size_run(report=lambda done, total: seen.append((done, total)), full=True):
        table = size_table("tiny", 3)
    assert seen == [(i, 6) for i in range(1, 7)]
    assert table == size_table("tiny", 3, full=True) == size_table("tiny", 3)


def test_the_committed_cosmos3_table_is_what_the_fast_path_computes() -> None:
    # Written by `docs/gen_sizes.py` before the replay existed, every call computed.
    committed = json.loads((ROOT / "docs" / "data" / "sizes-cosmos3-deploy-8.json").read_text())
    assert cli_size_table("deploy", 8, model="cosmos3") == committed
