"""`compile`: a whole ``step(state, *inputs) -> (state, out)`` under `torch.compile`.

Records trace natively: dynamo reads a record's fields as it reads any object's, guards on its
static fields (ring ``maxlen``, names, layout) and builds the successor inside the graph. This
module adds what JAX's ``jit`` gives a pytree step and `torch.compile` does not: one count of
input structures with a bound and a clear message, and donation (the successor written into
the storages of the record given, where nothing else holds them).
"""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
import torch.utils._pytree as torch_pytree
from torch._dynamo.utils import counters

from sessionstate._compile._donation import donatable_paths
from sessionstate._errors import DonatedRecordError, RecompileLimitError
from sessionstate._tree import tree_flatten

__all__ = ["CompiledStep", "compile"]

_S = TypeVar("_S")
_O = TypeVar("_O")

DEFAULT_MAX_STRUCTURES = 8


def _write_into(old: Any, new: Any, out: Any, donated: frozenset[str]) -> tuple[Any, Any]:
    """``new`` with each leaf at a donated path of ``old`` written into that old tensor.

    Runs inside the traced graph. A written tensor is replaced by the old one it was written
    into; a leaf of ``new`` or ``out`` that *is* a written old tensor (a ring's chunk moving
    one place down) is cloned first, so it keeps the value it had.
    """
    targets = {
        torch_pytree.keystr(path): leaf
        for path, leaf in torch_pytree.tree_flatten_with_path(old)[0]
        if torch_pytree.keystr(path) in donated
    }
    items, spec = torch_pytree.tree_flatten_with_path(new)
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    leaves: list[Any] = []
    replaced: list[bool] = []
    for path, leaf in items:
        target = targets.get(torch_pytree.keystr(path))
        fits = (
            target is not None
            and isinstance(leaf, torch.Tensor)
            and leaf.shape == target.shape
            and leaf.dtype == target.dtype
            and leaf.device == target.device
        )
        if fits and leaf is not target:
            assert target is not None  # (for mypy: `fits` says so)
            writes.append((target, leaf))
        leaves.append(target if fits else leaf)
        replaced.append(fits)
    written = [target for target, _ in writes]

    def keep(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and any(leaf is t for t in written):
            return leaf.clone()
        return leaf

    pending = [(target, keep(value)) for target, value in writes]
    kept = [leaf if took else keep(leaf) for leaf, took in zip(leaves, replaced, strict=True)]
    out = torch_pytree.tree_map(keep, out)
    for target, value in pending:
        target.copy_(value)
    return torch_pytree.tree_unflatten(kept, spec), out


def _run(
    step: Callable[..., Any], donated: tuple[str, ...], state: Any, args: Any, kwargs: Any
) -> Any:
    new, out = step(state, *args, **kwargs)
    if donated:
        new, out = _write_into(state, new, out, frozenset(donated))
    return new, out


def _structure(state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a new compile is keyed on: treespec (static fields included) and leaf kinds.

    Tensors by shape, dtype and device; strings, bytes, bools and None by value; anything else
    by type: ints and floats (dynamo makes a changing one dynamic after one recompile, so a
    step counter is not a new structure) and opaque leaves (a `GatheredKV`, a `KVHandle`),
    whose contents dynamo guards on itself.
    """
    leaves, spec = tree_flatten((state, args, kwargs))
    kinds: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            kinds.append((tuple(leaf.shape), leaf.dtype, leaf.device))
        elif type(leaf) in _BY_VALUE:
            kinds.append((type(leaf), leaf))
        else:
            kinds.append(type(leaf))
    return spec, tuple(kinds)


_BY_VALUE = frozenset({str, bytes, bool, type(None)})


def _calibrate() -> int:
    # References to the record that `CompiledStep.__call__`'s own frames hold when it asks
    # which leaves are donatable, measured once on a record held by one caller variable:
    # `_Probe` calls as `CompiledStep` does.
    probe = _Probe()
    record = _ProbeRecord()
    return probe(record) - 1


class _ProbeRecord:
    pass


class _Probe:
    def __call__(self, state: Any, /, *args: Any, **kwargs: Any) -> int:
        return self._count(state, args, kwargs)

    def _count(self, state: Any, args: Any, kwargs: Any) -> int:
        return sys.getrefcount(state) - 1  # less getrefcount's own argument


class CompiledStep(Generic[_S, _O]):
    """A step compiled whole by `compile`: call it as the step itself.

    Attributes:
        structures: How many input structures it has compiled for.
        compiles: How many graphs dynamo compiled for it (a structure compiles once; a
            changing int, once more, as it turns dynamic).
        donated: Calls that wrote the new record into the given one's storages.
        copied: Donating calls that found the record held elsewhere, and copied instead.
    """

    def __init__(
        self,
        step: Callable[..., tuple[_S, _O]],
        *,
        donate: bool,
        max_structures: int,
        compile_kwargs: dict[str, Any],
    ) -> None:
        self.step = step
        self.donate = donate
        self.max_structures = max_structures
        self.structures = 0
        self.compiles = 0
        self.donated = 0
        self.copied = 0
        self._seen: set[Any] = set()
        self._lock = threading.Lock()
        self._given: weakref.WeakSet[Any] = weakref.WeakSet()
        self._own = _calibrate()
        # A code object of its own: dynamo keeps its compiled graphs, and counts recompiles
        # against its limit, per code object, so compiled steps must not share `_run`'s.
        run = types.FunctionType(
            _run.__code__.replace(co_name=f"_run_{id(self):x}"), _run.__globals__, "_run"
        )
        self._compiled = torch.compile(run, fullgraph=True, **compile_kwargs)

    def __repr__(self) -> str:
        name = getattr(self.step, "__qualname__", repr(self.step))
        return (
            f"CompiledStep({name}, donate={self.donate}, structures={self.structures}, "
            f"compiles={self.compiles})"
        )

    def __call__(self, state: _S, /, *args: Any, **kwargs: Any) -> tuple[_S, _O]:
        return self._count(state, args, kwargs)

    def _count(self, state: Any, args: Any, kwargs: Any) -> tuple[_S, _O]:
        donated: tuple[str, ...] = ()
        if self.donate:
            self._refuse_donated(state)
            donated = donatable_paths(state, self._own, (args, kwargs))
        key = (_structure(state, args, kwargs), donated)
        with self._lock:
            if key not in self._seen:
                if len(self._seen) >= self.max_structures:
                    raise RecompileLimitError(self._limit_message())
                self._seen.add(key)
                self.structures = len(self._seen)
            before = counters["stats"]["unique_graphs"]
            # Our bound is the one that speaks: dynamo's own may not fall back to eager first.
            limit = max(torch._dynamo.config.recompile_limit, 2 * self.max_structures + 2)
            with torch._dynamo.config.patch(recompile_limit=limit):
                result = self._compiled(self.step, donated, state, args, kwargs)
            compiled = counters["stats"]["unique_graphs"] - before
        if compiled:
            self.compiles += compiled
            if self.donate:
                # Tracing leaves reference cycles that hold this record (dynamo's variable
                # trackers): collect them now, or the next call would find its tensors held.
                gc.collect()
        if self.donate:
            if donated:
                self.donated += 1
                self._given.add(state)
            else:
                self.copied += 1
        return result  # type: ignore[no-any-return]

    def _refuse_donated(self, state: object) -> None:
        try:
            given = state in self._given
        except TypeError:  # not weakly referenceable: never donated
            return
        if given:
            msg = (
                f"This `{type(state).__name__}` was donated to an earlier call of "
                f"{self!r}, which wrote its successor into its tensors; step from the record "
                "that call returned, or compile with `donate=False` to keep every record."
            )
            raise DonatedRecordError(msg)

    def _limit_message(self) -> str:
        name = getattr(self.step, "__qualname__", repr(self.step))
        return (
            f"`{name}` met a new input structure after compiling for "
            f"{self.max_structures} (`max_structures={self.max_structures}`). Each new "
            "treespec, static field, tensor shape, dtype or device compiles once, as "
            "`jax.jit` retraces; a value that changes every step (a str attribute, a "
            "growing shape) recompiles every step. Make it a tensor or keep it out of the "
            "record, or raise `max_structures`."
        )


def compile(
    step: Callable[..., tuple[_S, _O]],
    /,
    *,
    donate: bool = False,
    max_structures: int = DEFAULT_MAX_STRUCTURES,
    **compile_kwargs: Any,
) -> CompiledStep[_S, _O]:
    """Compile a whole ``step(state, *inputs) -> (state, out)`` with ``torch.compile``.

    The step is traced with ``fullgraph=True``: records go in and come out, their transitions
    (`SessionState.update_object`, `with_attrs`, `with_object`, ring and `TensorCache`
    commits, K/V reads and appends through `GatheredKV`) inside the graph. Static fields are
    guards; a new input structure compiles once, and the ``max_structures + 1``-th raises
    `RecompileLimitError` rather than falling back to eager. Outputs and records are
    bit-identical to eager under ``backend="aot_eager"``.

    With ``donate=True`` the new record is written into the storages of the record given,
    wherever a leaf at the same key path has the same shape, dtype and device (a ring's
    chunks, a cache rebuilt each step), so addresses stay put and the step holds one record.
    As with JAX's ``donate_argnums`` the caller's reference is consumed: step from the record
    returned, never the one given (stepping from it again raises `DonatedRecordError`). A
    leaf is donated only when nothing else holds it, its storage, or anything on the way to
    it; otherwise that call copies (`CompiledStep.copied`).

    Args:
        step: The step; its first argument is the record, and it returns ``(record, out)``.
        donate: Write the new record into the given one's storages where nothing else
            holds them.
        max_structures: How many input structures may compile before the next one raises.
        **compile_kwargs: Passed to `torch.compile` (``backend``, ``mode``, ``dynamic``,
            ``options``).

    Raises:
        ValueError: if ``max_structures`` is not a positive int.

    >>> import torch, sessionstate as ss
    >>> def step(state, x):
    ...     state = state.update_object("ring", lambda r: r.commit(x))
    ...     return state, state.object("ring").concat().sum()
    >>> fast = ss.compile(step, backend="aot_eager")
    >>> state = ss.SessionState(objects={"ring": ss.LatentBuffer(dim=0).allocate(maxlen=2)})
    >>> for i in range(3):
    ...     state, out = fast(state, torch.full((1,), float(i)))
    >>> out, fast.structures
    (tensor(3.), 3)
    """
    if type(max_structures) is not int or max_structures < 1:
        msg = (
            f"`max_structures` must be a positive int, got {max_structures!r} "
            f"({type(max_structures).__name__}); it bounds the input structures a compiled "
            "step compiles for."
        )
        raise ValueError(msg)
    return CompiledStep(
        step, donate=donate, max_structures=max_structures, compile_kwargs=compile_kwargs
    )
