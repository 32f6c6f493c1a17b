"""What the models' size tables share: one session run on both paths, counted per value.

A size table runs on ``meta``, where no arithmetic happens but every torch call still costs
its Python shape logic: a DreamZero deploy step was about a second of it, nearly all in the
stand-in denoiser and the Wan encoder. On meta a pure function's result layout is decided by
its arguments' layouts, so `replay_on_meta` runs each distinct call once and hands later
calls a fresh result of the recorded layout: the same shapes, strides, dtypes and storage
sizes, sharing storage with the arguments exactly where the real result did.

Two calls are alike when their tensor arguments have the same dtypes, shapes, strides and
storage sharing (and host tensors and other arguments the same values). Where a view starts
in its storage, and that storage's size, count too unless the result views no argument: no
meta kernel reads either. The tables count bytes by storage, so they cannot tell a replayed
result from a computed one; ``tests/models/test_sizes_replay.py`` checks every value's layout
against the full run, step by step, on both paths of both models.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from sessionstate import nbytes_by_device
from sessionstate._env import ENV_ENABLE
from sessionstate._tree import PyTree, PyTreeSpec, tree_flatten, tree_unflatten

__all__ = [
    "MetaReplay",
    "StepReport",
    "measure_both_paths",
    "replay_on_meta",
    "size_run",
    "values_table",
]

PipelineFactory = Callable[[Mapping[str, str]], Any]
"""Builds a model pipeline from an environment (the flag picks its path)."""

StepReport = Callable[[int, int], None]
"""Told ``(steps done, steps in all)`` after every step a size table runs, both paths counted."""


@attrs.frozen
class _SizeRun:
    report: StepReport | None = None
    full: bool = False


_RUN: contextvars.ContextVar[_SizeRun] = contextvars.ContextVar(
    "sessionstate_size_run",
    default=_SizeRun(),  # noqa: B039 - frozen: the default is never changed, only replaced
)


@contextlib.contextmanager
def size_run(*, report: StepReport | None = None, full: bool = False) -> Iterator[None]:
    """Within the block, every size table tells ``report`` its progress; ``full`` runs all.

    ``full=True`` runs every network call of the scripted episode instead of replaying
    their layouts (the table is the same; at deploy it takes minutes). The size tables are
    reached through the model registry, whose ``size_table(preset, steps)`` has no room for
    either; the command line sets them here.

    >>> seen = []
    >>> with size_run(report=lambda done, total: seen.append((done, total))):
    ...     from sessionstate.models.dreamzero.sizes import size_table
    ...     _ = size_table("tiny", 2)
    >>> seen
    [(1, 4), (2, 4), (3, 4), (4, 4)]
    """
    token = _RUN.set(_SizeRun(report, full))
    try:
        yield
    finally:
        _RUN.reset(token)


# -- replay of pure calls on meta ------------------------------------------------------------


@attrs.frozen
class _Made:
    """An output tensor with a storage of its own (``group``: outputs sharing one storage)."""

    group: int


@attrs.frozen
class _Shares:
    """An output tensor viewing the storage of argument leaf ``index``."""

    index: int


@attrs.frozen
class _Layout:
    """How to rebuild one output tensor: where its storage comes from, and its view of it."""

    storage: _Made | _Shares
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@attrs.frozen
class _Recipe:
    """A recorded result: its treespec and, per leaf, a layout, an argument or a constant."""

    spec: PyTreeSpec
    leaves: tuple[tuple[str, Any], ...]
    groups: tuple[int, ...]

    @property
    def views_arguments(self) -> bool:
        """Whether a result tensor views an argument's storage (not the argument itself)."""
        return any(
            kind == "tensor" and isinstance(what.storage, _Shares) for kind, what in self.leaves
        )


def _signature(leaves: Sequence[Any], *, exact: bool) -> tuple[Hashable, ...] | None:
    """What a pure call on meta can depend on, per argument leaf; None if it cannot be keyed.

    A meta tensor contributes its dtype, shape, strides and which earlier leaf, if any,
    shares its storage; ``exact`` adds where its view starts and its storage's size, which
    no meta kernel reads but a result viewing the argument's storage carries. Any other
    tensor contributes all of that and its values (it may be read); any other leaf itself,
    if hashable.
    """
    first: dict[int, int] = {}
    out: list[Hashable] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if type(leaf) is not torch.Tensor or leaf.layout != torch.strided:
                return None
            storage = leaf.untyped_storage()
            shared = first.setdefault(storage._cdata, i)
            layout = (leaf.dtype, tuple(leaf.shape), leaf.stride(), shared, leaf.requires_grad)
            if leaf.device.type != "meta":
                values = tuple(leaf.detach().cpu().flatten().tolist())
                out.append(
                    (str(leaf.device), *layout, leaf.storage_offset(), storage.nbytes(), values)
                )
            elif exact:
                out.append(("meta", *layout, leaf.storage_offset(), storage.nbytes()))
            else:
                out.append(("meta", *layout))
            continue
        try:
            hash(leaf)
        except TypeError:
            return None
        out.append((type(leaf), leaf))
    return tuple(out)


def _record(args: Sequence[Any], result: PyTree) -> _Recipe | None:
    """The recipe that rebuilds ``result`` for arguments of the same signature, or None."""
    leaves, spec = tree_flatten(result)
    arg_ids = {id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    arg_storages: dict[int, int] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            arg_storages.setdefault(a.untyped_storage()._cdata, i)
    made: dict[int, int] = {}
    groups: list[int] = []
    out: list[tuple[str, Any]] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and id(leaf) in arg_ids:
            out.append(("arg", arg_ids[id(leaf)]))  # an argument handed back as it was
        elif isinstance(leaf, torch.Tensor):
            if type(leaf) is not torch.Tensor or leaf.device.type != "meta":
                return None  # real values are not a layout: such a call is never replayed
            storage = leaf.untyped_storage()
            where: _Made | _Shares
            if storage._cdata in arg_storages:
                where = _Shares(arg_storages[storage._cdata])
            else:
                if storage._cdata not in made:
                    made[storage._cdata] = len(groups)
                    groups.append(storage.nbytes())
                where = _Made(made[storage._cdata])
            layout = _Layout(
                where, leaf.dtype, tuple(leaf.shape), leaf.stride(), int(leaf.storage_offset())
            )
            out.append(("tensor", layout))
        elif leaf is None or isinstance(leaf, (bool, int, float, str, torch.dtype)):
            out.append(("constant", leaf))
        else:
            return None
    return _Recipe(spec, tuple(out), tuple(groups))


def _rebuild(recipe: _Recipe, args: Sequence[Any]) -> PyTree:
    storages = [
        torch.empty(n, dtype=torch.uint8, device="meta").untyped_storage() for n in recipe.groups
    ]
    leaves: list[Any] = []
    for kind, what in recipe.leaves:
        if kind == "arg":
            leaves.append(args[what])
        elif kind == "constant":
            leaves.append(what)
        else:
            storage = (
                storages[what.storage.group]
                if isinstance(what.storage, _Made)
                else args[what.storage.index].untyped_storage()
            )
            empty = torch.empty(0, dtype=what.dtype, device="meta")
            leaves.append(empty.set_(storage, what.offset, what.size, what.stride))
    return tree_unflatten(recipe.spec, leaves)


class MetaReplay:
    """A pure function on meta tensors, run once per distinct argument layout and replayed.

    A call whose arguments have the layouts (and other arguments the values) of an earlier
    call gets a fresh result of that call's recorded layout. A result holding anything but
    meta tensors and plain constants, or arguments that cannot be keyed, are never replayed:
    the function runs. ``calls`` and ``runs`` count both.

    Args:
        fn: A pure function: no effect outside its result, and on meta, a result whose layout
            depends only on its arguments' layouts. The networks of both reference models are.
        recipes: The recorded results, shared between replays of the same function of
            networks built alike (the two paths of one size table).

    >>> double = MetaReplay(lambda x: torch.cat([x, x]))
    >>> a, b = (double(torch.empty(2, 3, device="meta")) for _ in range(2))
    >>> a.shape, b.shape, double.calls, double.runs
    (torch.Size([4, 3]), torch.Size([4, 3]), 2, 1)
    """

    def __init__(
        self, fn: Callable[..., Any], recipes: dict[Hashable, _Recipe | None] | None = None
    ) -> None:
        self.fn = fn
        self.recipes: dict[Hashable, _Recipe | None] = {} if recipes is None else recipes
        self.calls = 0
        self.runs = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        leaves, spec = tree_flatten((args, kwargs))
        keys = []
        for exact in (True, False):
            signature = _signature(leaves, exact=exact)
            if signature is not None:
                keys.append((exact, spec, signature))
        for key in keys:
            recipe = self.recipes.get(key)
            if recipe is not None:
                return _rebuild(recipe, leaves)
        self.runs += 1
        result = self.fn(*args, **kwargs)
        recipe = _record(leaves, result) if keys else None
        for key in keys:
            exact = key[0]
            # A result viewing an argument's storage is replayed only for the same view.
            if exact or (recipe is not None and not recipe.views_arguments):
                self.recipes.setdefault(key, recipe)
        return result


def replay_on_meta(
    nets: object, names: Iterable[str], shared: dict[str, dict[Hashable, Any]] | None = None, /
) -> dict[str, MetaReplay]:
    """Replace the methods ``names`` of ``nets`` (on their instances only) by `MetaReplay`\\ s.

    A dotted name reaches into an attribute: ``"denoiser.forward"`` replays the ``forward``
    of the module ``nets.denoiser``, which its ``__call__`` then finds. A replay inside a
    replayed method serves that method's own first runs. ``shared`` holds the recorded
    results by name; pass the same dict for networks built alike so the second learns from
    the first. Returns the replays by name.

    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> from sessionstate.models.dreamzero.networks import build_networks
    >>> nets = build_networks(DreamZeroConfig.preset("tiny"), device="meta")
    >>> replays = replay_on_meta(nets, ["prefill_kv"])
    >>> ref = torch.empty(1, 16, 1, 4, 8, device="meta")
    >>> _ = nets.prefill_kv(ref), nets.prefill_kv(ref)
    >>> replays["prefill_kv"].calls, replays["prefill_kv"].runs
    (2, 1)
    """
    shared = {} if shared is None else shared
    replays = {}
    for name in names:
        *path, method = name.split(".")
        owner = nets
        for attribute in path:
            owner = getattr(owner, attribute)
        replays[name] = MetaReplay(getattr(owner, method), shared.setdefault(name, {}))
        # An instance attribute shadows the method for this object only; the class is intact.
        setattr(owner, method, replays[name])
    return replays


# -- the size table --------------------------------------------------------------------------


def measure_both_paths(
    build: PipelineFactory,
    episode: Callable[[], Iterable[tuple[str, Any]]],
    /,
    *,
    steps: int,
    replay: Sequence[str] = (),
    meta_episode: Callable[[], Iterable[tuple[str, Any]]] | None = None,
    full: bool = False,
) -> tuple[dict[str, dict[str, int]], dict[str, int], dict[str, dict[str, Any]], frozenset[str]]:
    """Run ``episode`` on the bespoke path, then on the managed one, and count session-0.

    Args:
        build: The pipeline of a path, from its environment.
        episode: The scripted episode: ``steps`` forward calls, each ``(session id, input)``.
        steps: The episode's length, for the progress report (see `size_run`).
        replay: Methods of the pipeline's ``nets`` to run through `replay_on_meta`; the
            two paths share their recordings.
        meta_episode: The same steps with their inputs on meta where no value of them
            reaches a byte count; run instead of ``episode`` when replaying.
        full: Run ``episode`` with every call in full, as does `size_run` ``(full=True)``.

    Returns, per path (``"bespoke"``, ``"managed"``): the bytes of each value, the session's
    bytes with every storage counted once, and the values themselves; then the names of the
    managed record's state objects that are not parkable (a budgeted manager's parking
    leaves them on the device: the `RandomKey`).

    >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    >>> from sessionstate.models.dreamzero.episode import scripted_episode
    >>> cfg = DreamZeroConfig.preset("tiny")
    >>> held, totals, _, unparkable = measure_both_paths(
    ...     lambda env: DreamZeroPipeline(cfg, device="meta", host_device="meta", environ=env),
    ...     lambda: scripted_episode(cfg, steps=2, sessions=1, seed=0),
    ...     steps=2,
    ... )
    >>> sorted(totals), held["managed"]["call_count"], sorted(unparkable)
    (['bespoke', 'managed'], 0, ['random_key'])
    """
    run = _RUN.get()
    full = full or run.full
    steps_of = episode if full or meta_episode is None else meta_episode
    held: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    values_by_path: dict[str, dict[str, Any]] = {}
    recorded: dict[str, dict[Hashable, Any]] = {}
    unparkable: frozenset[str] = frozenset()
    done = 0
    for flag, name in (("0", "bespoke"), ("1", "managed")):
        pipe = build({ENV_ENABLE: flag})
        if not full:
            replay_on_meta(pipe.nets, replay, recorded)
        for sid, inputs in steps_of():
            pipe.forward(inputs, sid)
            done += 1
            if run.report is not None:
                run.report(done, 2 * steps)
        values = pipe.session_values("session-0")
        held[name] = {k: sum(nbytes_by_device(v).values()) for k, v in values.items()}
        totals[name] = sum(nbytes_by_device(list(values.values())).values())
        values_by_path[name] = values
        if pipe.manager is not None:
            record = pipe.manager.peek("session-0")
            objects = {} if record is None else record.objects
            unparkable = frozenset(k for k, o in objects.items() if not o.parkable)
    return held, totals, values_by_path, unparkable


def values_table(
    held: Mapping[str, Mapping[str, int]],
    buckets: Mapping[str, str],
    unparkable: Iterable[str] | None = None,
    /,
) -> dict[str, dict[str, Any]]:
    """The ``values`` section of a size table: each value's bucket and bytes on both paths.

    Given the names of the state objects that are not parkable (see `measure_both_paths`),
    each row also says whether a budgeted manager's parking moves the value off the device
    (``parkable``): an attribute, or an object that is not parkable, stays.

    >>> values_table({"managed": {"x": 4}, "bespoke": {"x": 8}}, {"x": "attrs"})
    {'x': {'bucket': 'attrs', 'managed_nbytes': 4, 'bespoke_nbytes': 8}}
    >>> held = {"managed": {"key": 16, "kv": 8}, "bespoke": {"key": 16, "kv": 8}}
    >>> rows = values_table(held, {"key": "object", "kv": "engine"}, ["key"])
    >>> rows["key"]["parkable"], rows["kv"]["parkable"]
    (False, True)
    """
    table: dict[str, dict[str, Any]] = {
        k: {
            "bucket": buckets[k],
            "managed_nbytes": held["managed"][k],
            "bespoke_nbytes": held["bespoke"][k],
        }
        for k in buckets
    }
    if unparkable is not None:
        stay = set(unparkable)
        for k, row in table.items():
            row["parkable"] = row["bucket"] != "attrs" and k not in stay
    return table
