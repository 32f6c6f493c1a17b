"""What both reference models' session paths share: the bespoke table and the managed rules.

A model is its networks, its state records and its step. Session bookkeeping is written once
here, so the two models cannot drift apart: the bespoke path's capped table (`SessionTable`:
cap, ``on_full``, ``begin``, the once-per-table eviction warning, the counters), the managed
path's manager built from every resolved setting (`build_manager`, `ManagedPathBase`), its
"publish only after the whole step succeeded" rule (`managed_forward`), its read of a session
that may be parked (`resident`), its prefetch of the session a scheduler steps next
(`prefetch`), and the pipeline's part that is the same whichever path runs
(`TwoPathPipeline`, over any `SessionPath`).
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

from sessionstate import (
    EnginePool,
    OmniDiffusionConfig,
    RandomKey,
    SessionAdmissionError,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
    SessionStateSettings,
    nbytes_by_device,
    resolve_session_state_config,
)
from sessionstate._accounting import storage_entries
from sessionstate._checks import (
    an_int,
    check_bool,
    check_session_id,
    is_int,
    one_of,
    positive_int,
)
from sessionstate._env import ENV_KV_POOL_BYTES
from sessionstate._kv._pool import kv_shortfall, session_blocks

# Besides its own parts, the kit passes on the library's checks that the models' configs and
# pipelines use, so a reference model imports only public names and this kit.
__all__ = [
    "ENV_KV_POOL_BYTES",
    "SessionMessages",
    "SessionPath",
    "SessionTable",
    "TwoPathPipeline",
    "an_int",
    "buckets",
    "build_manager",
    "check_batch",
    "check_session_id",
    "device_key",
    "is_int",
    "kv_shortfall",
    "live_key",
    "managed_forward",
    "one_of",
    "positive_int",
    "prefetch",
    "resident",
    "session_blocks",
    "split_bespoke",
]

logger = logging.getLogger("sessionstate")

S = TypeVar("S")
R = TypeVar("R", bound=SessionState)
O = TypeVar("O")  # noqa: E741 - a step's output, as in `step(state, x) -> (state, out)`


class SessionMessages:
    """The messages both paths give for a session that is not held, worded per model.

    Args:
        model: How messages name the model (``"DreamZero"``).
        argument: The name of ``forward``'s input in the fix (``"obs"``).

    >>> messages = SessionMessages("Toy", "obs")
    >>> messages.unknown("a")
    "Toy session 'a' is not held (never started, dropped or evicted); call `forward(obs, session_id)` to start it."
    """  # noqa: E501 - a doctest's expected output is one line

    def __init__(self, model: str, argument: str) -> None:
        self.model = model
        self.argument = argument

    def unknown(self, session_id: Hashable) -> str:
        """The message for a lookup of a session that is not held."""
        return (
            f"{self.model} session {session_id!r} is not held (never started, dropped or "
            f"evicted); call `forward({self.argument}, session_id)` to start it."
        )

    def lost(self, session_id: Hashable) -> str:
        """The message for ``forward(..., begin=False)`` of a session that is not held."""
        return (
            f"Cannot continue {self.model} session {session_id!r}: it is not held (never "
            "started, dropped or evicted), so its state is lost. Start it again with "
            f"`forward({self.argument}, {session_id!r}, begin=True)`, or raise the session cap."
        )


class SessionTable(Generic[S]):
    """Session id to mutable state, least recently used first, capped as upstream.

    Counts hits, misses and evictions the way the manager counts them, and warns once on the
    first eviction.

    Args:
        model: How messages name the model (``"DreamZero"``).
        new: Makes a new session's state.
        max_sessions: The cap.
        on_full: At the cap, ``"evict"`` the least recently used session or ``"refuse"`` the
            new one with `SessionAdmissionError`.
        lost: The message of a continuation (``begin=False``) of a session not held.
        unknown: The message of a read of a session not held.

    >>> table = SessionTable("Toy", dict, 1, "evict", lost=str, unknown=str)
    >>> first = table.state("a", None)
    >>> table.state("a", None) is first, table.counts
    (True, {'hits': 1, 'misses': 1, 'evictions': 0})
    """

    def __init__(
        self,
        model: str,
        new: Callable[[], S],
        max_sessions: int,
        on_full: str,
        *,
        lost: Callable[[Hashable], str],
        unknown: Callable[[Hashable], str],
    ) -> None:
        self.states: OrderedDict[Hashable, S] = OrderedDict()
        self.model = model
        self.new = new
        self.max_sessions = max_sessions
        self.on_full = on_full
        self.counts = {"hits": 0, "misses": 0, "evictions": 0}
        self._lost = lost
        self._unknown = unknown
        self._warned_eviction = False

    def state(self, session_id: Hashable, begin: bool | None) -> S:
        """The session's state to step: held (now most recently used), or new.

        Args:
            session_id: The session.
            begin: ``True`` starts the session afresh (replacing a held one), ``False``
                continues a held one and never starts one, ``None`` does either.

        Raises:
            SessionStateLostError: if ``begin`` is False and the session is not held.
            SessionAdmissionError: if the session is new, the table is full and ``on_full``
                is ``"refuse"``.
        """
        states = self.states
        state = None if begin else states.get(session_id)
        if state is not None:
            self.counts["hits"] += 1
            states.move_to_end(session_id)
            return state
        if begin and session_id in states:  # a restart replaces the held state
            state = states[session_id] = self.new()
            states.move_to_end(session_id)
            return state
        if not begin:  # counted as the manager's `get` counts it
            self.counts["misses"] += 1
        if begin is False:
            raise SessionStateLostError(self._lost(session_id))
        if self.on_full == "refuse" and len(states) >= self.max_sessions:
            msg = (
                f"Cannot admit {self.model} session {session_id!r}: the bespoke session table "
                f"holds {self.max_sessions} sessions (its cap) and "
                "`on_full='refuse'`. Drop a finished session first with `drop_session`, or "
                "raise the cap."
            )
            raise SessionAdmissionError(msg)
        state = states[session_id] = self.new()
        if len(states) > self.max_sessions:
            evicted, _ = states.popitem(last=False)
            self.counts["evictions"] += 1
            if not self._warned_eviction:
                self._warned_eviction = True
                logger.warning(
                    "%s session %r was evicted by the bespoke session cap (%d) although "
                    "nobody ended it; its state is lost. End finished sessions explicitly with "
                    "`drop_session(session_id)`, or raise the cap. Warned once per pipeline; "
                    "`stats()['evictions']` counts every eviction.",
                    self.model,
                    evicted,
                    self.max_sessions,
                )
        return state

    def held(self, session_id: Hashable) -> S:
        """The held state of ``session_id``, leaving the LRU order alone.

        Raises:
            SessionStateLostError: if the session is not held.
        """
        state = self.states.get(session_id)
        if state is None:
            raise SessionStateLostError(self._unknown(session_id))
        return state

    def drop(self, session_id: Hashable) -> bool:
        """End a session; returns whether it was held."""
        return self.states.pop(session_id, None) is not None

    def fork(
        self, source_id: Hashable, branch_ids: tuple[Hashable, ...], *, share_random: bool = False
    ) -> None:
        """Branch a session the bespoke way: each branch a deep copy of the source's state.

        A state's ``random_key`` is split as the manager's `fork` splits a record's
        (`split_bespoke`), or kept by every copy with ``share_random=True``.

        The source becomes the most recently used, then the branches in order; at the cap
        the least recently used others are evicted (``on_full="refuse"``: refused whole).

        Raises:
            SessionStateLostError: if the source is not held.
            ValueError: if a branch id is held already or repeated.
            SessionAdmissionError: if the cap cannot hold the branches beside the source.
        """
        state = self.held(source_id)
        if len(set(branch_ids)) != len(branch_ids) or any(b in self.states for b in branch_ids):
            msg = (
                f"Cannot fork {self.model} session {source_id!r} into {list(branch_ids)}: a "
                "branch id is held already or named twice. Name new ids."
            )
            raise ValueError(msg)
        free = self.max_sessions - len(self.states)
        if len(branch_ids) >= self.max_sessions or (
            self.on_full == "refuse" and len(branch_ids) > free
        ):
            msg = (
                f"Cannot fork {self.model} session {source_id!r} into {len(branch_ids)} "
                f"branches: the bespoke session table (cap {self.max_sessions}) cannot hold "
                "them beside the source. Fork into fewer, or drop finished sessions."
            )
            raise SessionAdmissionError(msg)
        copies = [copy.deepcopy(state) for _ in branch_ids]
        split_bespoke(state, copies, share_random=share_random)
        self.states.move_to_end(source_id)
        for branch_id, branch in zip(branch_ids, copies, strict=True):
            self.states[branch_id] = branch
            if len(self.states) > self.max_sessions:
                self.states.popitem(last=False)
                self.counts["evictions"] += 1
        self.counts["forks"] = self.counts.get("forks", 0) + len(branch_ids)

    def stats(self, values: Callable[[Hashable], Mapping[str, object]]) -> dict[str, int]:
        """The manager's `stats()` keys, computed by hand over every session's ``values``
        (each storage once)."""
        held = [values(sid) for sid in self.states]
        totals = nbytes_by_device(held) if held else {}
        out = {"sessions": len(self.states), "max_sessions": self.max_sessions, **self.counts}
        out["total_nbytes"] = sum(totals.values())
        out.update({f"nbytes:{d}": n for d, n in sorted(totals.items())})
        # As the manager: both keys always, the sharing counted once a fork was made.
        out["forks"] = self.counts.get("forks", 0)
        out["shared_sessions"] = _sharing(held) if out["forks"] else 0
        return out


def _sharing(held: list[Mapping[str, object]]) -> int:
    """How many of ``held`` reach a storage another of them reaches too."""
    identities = [{entry[1] for entry in storage_entries(values)} for values in held]
    count = 0
    for i, mine in enumerate(identities):
        count += any(not mine.isdisjoint(other) for j, other in enumerate(identities) if j != i)
    return count


class SessionPath(Protocol):
    """What each session path of a reference model provides, bespoke or managed."""

    def forward(self, inputs: Any, session_id: Hashable, begin: bool | None, /) -> Any:
        """One step of ``session_id``."""
        ...

    def drop_session(self, session_id: Hashable, /) -> bool:
        """End a session; returns whether it was held."""
        ...

    def session_ids(self) -> list[Hashable]:
        """Retained sessions, least recently used first."""
        ...

    def session_values(self, session_id: Hashable, /) -> dict[str, object]:
        """Every value the session holds or reads, by name (leaving the LRU order alone)."""
        ...

    def fork(
        self, source_id: Hashable, /, *branch_ids: Hashable, share_random: bool = False
    ) -> None:
        """Branch a session into new ones that continue from its state (keys split, or
        shared)."""
        ...

    def video_latents(self, session_id: Hashable, /) -> torch.Tensor | None:
        """Every chunk generated for the session, joined along time (None if none)."""
        ...

    def stats(self) -> dict[str, int]:
        """The manager's `stats()` keys."""
        ...


def check_bespoke_cap(max_bespoke_sessions: object, upstream: int) -> None:
    """Refuse a bespoke session cap that is not a positive int, naming upstream's cap.

    >>> check_bespoke_cap(0, 64)
    Traceback (most recent call last):
    ValueError: `max_bespoke_sessions` must be a positive int, got 0; the bespoke path's cap is 64 upstream.
    """  # noqa: E501 - a doctest's expected output is one line
    if not is_int(max_bespoke_sessions) or max_bespoke_sessions <= 0:
        msg = (
            f"`max_bespoke_sessions` must be a positive int, got {max_bespoke_sessions!r}; "
            f"the bespoke path's cap is {upstream} upstream."
        )
        raise ValueError(msg)


class BespokePathBase(Generic[S]):
    """What every reference model's bespoke path does alike, over its `SessionTable`.

    Ends, branches and lists sessions; a model's path adds its ``forward`` and whatever it
    reads of a session (``session_values``, ``video_latents``, ``stats``).

    Args:
        table: The path's table of mutable session states.

    >>> path = BespokePathBase(SessionTable("Toy", dict, 2, "evict", lost=str, unknown=str))
    >>> _ = path.table.state("a", None)
    >>> path.session_ids(), path.drop_session("a"), path.session_ids()
    (['a'], True, [])
    """

    def __init__(self, table: SessionTable[S]) -> None:
        self.table = table

    def drop_session(self, session_id: Hashable) -> bool:
        """End a session; returns whether it was held."""
        return self.table.drop(session_id)

    def fork(
        self, source_id: Hashable, /, *branch_ids: Hashable, share_random: bool = False
    ) -> None:
        """Branch a session the bespoke way: a deep copy of its state per branch (its random
        key split as the manager splits it, or shared)."""
        self.table.fork(source_id, branch_ids, share_random=share_random)

    def session_ids(self) -> list[Hashable]:
        """Retained sessions, least recently used first."""
        return list(self.table.states)


class ManagedPathBase(Generic[R]):
    """What every reference model's managed path does alike, over its `SessionStateManager`.

    Builds the manager from every resolved setting (`build_manager`) and answers the calls
    that only read or drop sessions; a model's path adds its ``forward`` (through
    `managed_forward`), its pure ``step`` and ``new_session``, and whatever it reads of a
    session (``video_latents``).

    Args:
        model: The model's networks and geometry (with a ``device``).
        settings: The resolved session-state settings.
        record: The model's session record class.
        unknown: The message for a session that is not held.
        pools: The engine pools the model's records hold blocks of (the manager makes their
            room).
    """

    def __init__(
        self,
        model: Any,
        settings: SessionStateSettings,
        record: type[R],
        unknown: Callable[[Hashable], str],
        *,
        pools: tuple[EnginePool, ...] = (),
        lost: Callable[[Hashable], str] | None = None,
    ) -> None:
        self.model = model
        self.manager: SessionStateManager[R] = build_manager(
            record, settings, model.device, pools=pools
        )
        self._unknown = unknown
        self._lost = lost

    def new_session(self) -> R:
        """An empty session for this model's geometry (the model's path defines it)."""
        raise NotImplementedError

    def step_batch(
        self, states: Sequence[R], inputs: Sequence[Any], *, batch_invariant: bool = False
    ) -> tuple[list[R], list[Any]]:
        """The model's pure batched step (the model's path defines it)."""
        raise NotImplementedError

    def forward_many(
        self, inputs: Mapping[Hashable, Any], begin: bool | None, batch_invariant: bool
    ) -> dict[Hashable, Any]:
        """One batched step of every session in ``inputs`` (`SessionStateManager.step_many`
        over the model's `step_batch`): all of them stepped and published, or none."""
        ids = list(inputs)
        xs = [inputs[sid] for sid in ids]

        def run(states: list[R]) -> tuple[list[R], list[Any]]:
            return self.step_batch(states, xs, batch_invariant=batch_invariant)

        outs = self.manager.step_many(ids, run, new=self.new_session, begin=begin, lost=self._lost)
        return dict(zip(ids, outs, strict=True))

    def drop_session(self, session_id: Hashable) -> bool:
        """End a session; returns whether it was held."""
        return self.manager.drop(session_id)

    def session_ids(self) -> list[Hashable]:
        """Retained sessions, least recently used first."""
        return self.manager.session_ids()

    def session_values(self, session_id: Hashable) -> dict[str, object]:
        """Every value the session holds, by name (without touching LRU order)."""
        values: dict[str, object] = self._peek(session_id).values()  # type: ignore[attr-defined]
        return values

    def fork(
        self, source_id: Hashable, /, *branch_ids: Hashable, share_random: bool = False
    ) -> None:
        """Branch a session: `SessionStateManager.fork` (no tensor copied)."""
        self.manager.fork(source_id, *branch_ids, share_random=share_random)

    def stats(self) -> dict[str, int]:
        """The manager's `stats()`."""
        return self.manager.stats()

    def _peek(self, session_id: Hashable) -> R:
        # A parked session is read through a resident copy; the stored record stays parked.
        return resident(self.manager, session_id, self._unknown)


C = TypeVar("C")


def resolve_model(
    config: OmniDiffusionConfig | C,
    cls: type[C],
    from_dict: Callable[[Mapping[str, Any]], C],
    environ: Mapping[str, str] | None,
) -> tuple[C, SessionStateSettings]:
    """A pipeline's model config and session-state settings, from either form of config.

    A deploy config gives both (its ``model`` section parsed by ``from_dict``); a model
    config of class ``cls`` gives itself, with the settings from the environment alone.
    """
    if isinstance(config, cls):
        return config, resolve_session_state_config(None, environ)
    assert isinstance(config, OmniDiffusionConfig)
    return config.parse_model(from_dict), resolve_session_state_config(config, environ)


class TwoPathPipeline(Generic[R]):
    """What every reference model's pipeline does alike, whichever path runs.

    A pipeline (`DreamZeroPipeline`, `Cosmos3Pipeline`) sets ``settings``, ``_path`` (the
    path that runs) and ``_managed`` (the managed path, or None on the bespoke one); this
    part holds the manager's accessors and the calls that only pass a session to the path.
    Its own ``forward``, ``step``, ``new_session`` and ``prefetch`` are the model's.
    """

    settings: SessionStateSettings
    _path: SessionPath
    _managed: ManagedPathBase[R] | None  # the model's `ManagedPath`, or None

    @property
    def manager(self) -> SessionStateManager[R] | None:
        """The managed path's manager; None on the bespoke path.

        Assignable on the managed path (a test swaps in a manager with another cap).
        """
        return None if self._managed is None else self._managed.manager

    @manager.setter
    def manager(self, manager: SessionStateManager[R]) -> None:
        assert self._managed is not None, "the bespoke path has no manager"
        self._managed.manager = manager

    @property
    def managed(self) -> bool:
        """Whether this pipeline runs the manager-backed path."""
        return self._managed is not None

    @property
    def on_full(self) -> str:
        """What a new session does at the cap, on either path: ``"evict"`` or ``"refuse"``.

        >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
        >>> env = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL": "refuse"}
        >>> DreamZeroPipeline(DreamZeroConfig.preset("tiny"), environ=env).on_full
        'refuse'
        """
        return self.settings.on_full

    def forward_many(
        self,
        inputs: Mapping[Hashable, Any],
        /,
        *,
        begin: bool | None = None,
        batch_invariant: bool = False,
    ) -> dict[Hashable, Any]:
        """Step many sessions at once: ``{session_id: input}`` in, ``{session_id: output}`` out.

        On the managed path the sessions are one batch (`SessionStateManager.step_many`): one
        room check for all of them, their records read together, the model's pure
        ``step_batch`` run once (its networks once per shape bucket: sessions whose tensors
        have one shape, such as the same position in a window), and every record published
        only if the whole batch succeeded; a failure leaves every session of the batch at
        its previous record. With ``batch_invariant`` each output equals ``forward`` of the
        session alone, bit for bit; without it outputs agree to within rounding (the
        Batches page states by how much). The bespoke path steps the sessions one by one,
        in the order given (a failure stops there; the sessions before it are stepped).

        Args:
            inputs: Each session's input, in the order to step them.
            begin: As `forward`, for every session.
            batch_invariant: Run the networks' non-invariant kernels once per session.

        Raises:
            ValueError: for no session.
            TypeError: for a ``batch_invariant`` or ``begin`` of the wrong type.
            SessionStateLostError: if ``begin=False`` and a session is not held.
            KVPoolExhaustedError: if the pools cannot hold the batch's steps: step fewer
                sessions at a time.
        """
        if not isinstance(inputs, Mapping) or not inputs:
            msg = (
                f"`forward_many` takes a non-empty mapping of session id to input, got "
                f"{inputs!r}; pass `{{session_id: input, ...}}`."
            )
            raise ValueError(msg)
        for session_id in inputs:
            check_session_id(session_id)
        check_bool(batch_invariant, "batch_invariant")
        if begin is not None:
            check_bool(begin, "begin")
        if self._managed is None:
            return {sid: self._path.forward(x, sid, begin) for sid, x in inputs.items()}
        return self._managed.forward_many(inputs, begin, batch_invariant)

    def drop_session(self, session_id: Hashable) -> bool:
        """End a session on either path; returns whether it was held."""
        check_session_id(session_id)
        return self._path.drop_session(session_id)

    def session_ids(self) -> list[Hashable]:
        """Retained sessions, least recently used first."""
        return self._path.session_ids()

    def session_values(self, session_id: Hashable) -> dict[str, object]:
        """Every value the session holds or reads, by name (without touching LRU order).

        On a bespoke path that keeps state outside its sessions, that state is included as
        the next step of this session would read it (Cosmos3's ``text_kv`` and
        ``rope_freqs``: the transformer instance's cache, shared by every session).
        """
        check_session_id(session_id)
        return self._path.session_values(session_id)

    def video_latents(self, session_id: Hashable) -> torch.Tensor | None:
        """Every chunk generated for the session, joined along time (None if none)."""
        check_session_id(session_id)
        return self._path.video_latents(session_id)

    def fork(
        self, source_id: Hashable, /, *branch_ids: Hashable, share_random: bool = False
    ) -> None:
        """Branch ``source_id`` into new sessions that continue from its latest state.

        Each branch then steps on its own (``forward(x, branch_id)``), as a copy of the
        source would. On the managed path nothing is copied: the branches hold the source's
        record (`SessionStateManager.fork`), KV blocks included, and a step copies only what
        it writes; on the bespoke path each branch is a deep copy of the source's state.

        The session's random key is split on both paths alike: the source keeps the first of
        ``len(branch_ids) + 1`` keys split from it, each branch one of the others, so every
        branch draws its own noise. ``share_random=True`` keeps the key in every branch: each
        draws the noise the source would.

        Raises:
            SessionStateLostError: if the source is not held.
            ValueError: if no branch is named, or a branch id is held already or repeated.
            SessionAdmissionError: if the session cap cannot hold the branches.
        """
        check_session_id(source_id)
        for branch_id in branch_ids:
            check_session_id(branch_id)
        if not branch_ids:
            msg = f"`fork({source_id!r})` names no branch; pass the new ids: `fork(source, 'b1')`."
            raise ValueError(msg)
        share_random = check_bool(share_random, "share_random")
        self._path.fork(source_id, *branch_ids, share_random=share_random)

    def stats(self) -> dict[str, int]:
        """The manager's `stats()`; on the bespoke path, the same keys computed by hand (each
        storage once, state kept outside the sessions included)."""
        return self._path.stats()

    def session_stats(self, session_id: Hashable, /) -> dict[str, Any]:
        """One session's footprint: the manager's `SessionStateManager.session_stats`.

        For a server that returns it with a step's output: ``pipe.forward(x, sid)``, then
        ``pipe.session_stats(sid)``; it leaves the LRU order and the counters alone.

        Raises:
            RuntimeError: on the bespoke path, which keeps no ledger to read it from.
            SessionStateLostError: if the session is not held.

        >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
        >>> env = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
        >>> from sessionstate.models.dreamzero.episode import scripted_episode
        >>> pipe = DreamZeroPipeline(DreamZeroConfig.preset("tiny"), environ=env)
        >>> (sid, obs), = scripted_episode(pipe.cfg, steps=1, sessions=1, seed=0)
        >>> _ = pipe.forward(obs, sid)
        >>> pipe.session_stats(sid)["resident"]
        True
        """
        check_session_id(session_id)
        if self._managed is None:
            msg = (
                f"`session_stats({session_id!r})` reads the session-state manager's ledger; "
                "this pipeline runs the bespoke path, which keeps none. Enable the manager "
                "(OMNI_DIFFUSION_SESSION_STATE_MANAGER=1), or use `session_values` and "
                "`nbytes_by_device` for a session's bytes."
            )
            raise RuntimeError(msg)
        return self._managed.manager.session_stats(session_id)


def device_key(device: torch.device) -> str:
    """How a budget names ``device``: as its tensors report it (CUDA with its index).

    >>> device_key(torch.device("cpu"))
    'cpu'
    """
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def build_manager(
    record: type[R],
    settings: SessionStateSettings,
    device: torch.device,
    *,
    pools: tuple[EnginePool, ...] = (),
) -> SessionStateManager[R]:
    """The managed path's manager, honouring every resolved setting.

    The cap, ``on_full``, the immutability guard, the byte budget (a single count is a budget
    for the model's ``device``), the park tier, the spool directory and the host tier's
    buffer pool (``host_pool_bytes``, ``host_pool_full``), and whether unparks keep their
    copies (``keep_parked_copies``).

    Args:
        record: The model's session record class (it types the manager).
        settings: The resolved session-state settings.
        device: The model's device.

    >>> from sessionstate import SessionState, resolve_session_state_config
    >>> settings = resolve_session_state_config(None, {"OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES": "1KiB"})
    >>> build_manager(SessionState, settings, torch.device("cpu")).max_bytes
    {'cpu': 1024}
    """  # noqa: E501 - a doctest line
    budget = settings.max_bytes
    return SessionStateManager[R](
        settings.max_sessions,
        on_full=settings.on_full,
        check_immutable=settings.check_immutable,
        max_bytes={device_key(device): budget} if isinstance(budget, int) else budget,
        park_tier=settings.park_tier,
        spool_dir=settings.spool_dir,
        host_pool_bytes=settings.host_pool_bytes,
        host_pool_full=settings.host_pool_full,
        keep_parked_copies=settings.keep_parked_copies,
        pools=pools,
    )


def live_key(key: RandomKey, seed: int) -> RandomKey:
    """The key a step draws from: ``key``, or, when it is not allocated, ``seed``'s.

    A session's key is seeded from its model config's ``seed`` when the session starts
    (`RandomKey.seeded`), never from its id: a session's noise depends on its inputs and the
    config, whatever it is called and on whichever path it runs. A record saved before
    sessions held keys loads with a key not allocated, and draws from the config's seed at its
    next step.

    >>> live_key(RandomKey(), 3).view().tolist(), live_key(RandomKey.seeded(1), 3).counter
    ([3, 0], 0)
    """
    return key if key.is_allocated else key.allocate(seed=seed)


def split_bespoke(source: Any, branches: list[Any], *, share_random: bool) -> None:
    """Give a bespoke fork's source and branches their keys, as the manager's `fork` does.

    ``source`` and each of ``branches`` (its deep copies) hold a `RandomKey` as
    ``random_key`` (if they hold none, nothing changes). Split (the default), the source's key
    becomes the first of ``len(branches) + 1`` keys split from it and each branch takes one
    of the others, in order (`SessionState.split_random`); shared, every copy keeps the key.

    >>> class State:
    ...     random_key = RandomKey.seeded(0)
    >>> src, b = State(), State()
    >>> split_bespoke(src, [b], share_random=False)
    >>> [k.tolist() for k in (src.random_key.view(), b.random_key.view())] == [
    ...     k.view().tolist() for k in RandomKey.seeded(0).split(2)]
    True
    """
    key = getattr(source, "random_key", None)
    if share_random or not isinstance(key, RandomKey):
        return
    keys = key.split(len(branches) + 1)
    source.random_key = keys[0]
    for branch, branch_key in zip(branches, keys[1:], strict=True):
        branch.random_key = branch_key


def prefetch(
    manager: SessionStateManager[R] | None, session_id: Hashable, *, make_room: bool = False
) -> bool:
    """Start unparking ``session_id`` in the background (`SessionStateManager.prefetch`).

    What both pipelines' ``prefetch`` do; False on the bespoke path (``manager`` None), for a
    session not held or not parked, and for a prefetch that does not fit (the manager also
    keeps room in its engine pools for the restored session beside a step's).

    >>> from sessionstate import SessionState
    >>> prefetch(None, "a"), prefetch(SessionStateManager[SessionState](), "a")
    (False, False)
    """
    check_session_id(session_id)
    if manager is None:
        return False
    return manager.prefetch(session_id, make_room=make_room)


def check_batch(states: Sequence[Any], inputs: Sequence[Any]) -> None:
    """Refuse a batched step given a different number of records and inputs.

    >>> check_batch([1, 2], ["x"])
    Traceback (most recent call last):
    ValueError: A batched step got 2 records and 1 inputs; pass one input per record, in order.
    """
    if len(states) != len(inputs):
        msg = (
            f"A batched step got {len(states)} records and {len(inputs)} inputs; pass one "
            "input per record, in order."
        )
        raise ValueError(msg)


def buckets(items: Sequence[S], *, key: Callable[[S], Hashable]) -> list[list[int]]:
    """The positions of ``items`` grouped by ``key``, groups in order of first appearance.

    A batched step runs each group through its networks as one batch (a shape bucket).

    >>> buckets(["a", "bb", "c", "dd", "eee"], key=len)
    [[0, 2], [1, 3], [4]]
    """
    groups: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return list(groups.values())


def managed_forward(
    manager: SessionStateManager[R],
    session_id: Hashable,
    begin: bool | None,
    *,
    new: Callable[[], R],
    step: Callable[[R], tuple[R, O]],
    lost: Callable[[Hashable], str],
) -> O:
    """One managed step of ``session_id`` (`SessionStateManager.step`): the manager makes its
    room (bytes and engine blocks), reads it, runs ``step`` inside its pools' transactions,
    and publishes only if the step succeeded.

    Args:
        manager: Holds the latest record of every session.
        session_id: The session.
        begin: As `SessionTable.state`.
        new: Makes a new session's record.
        step: ``step(state) -> (state, out)``, pure.
        lost: The message of a continuation of a session not held.

    Raises:
        SessionStateLostError: if ``begin`` is False and the session is not held.
    """
    return manager.step(session_id, step, new=new, begin=begin, lost=lost)


def resident(
    manager: SessionStateManager[R], session_id: Hashable, unknown: Callable[[Hashable], str]
) -> R:
    """The latest record of ``session_id``, resident, leaving the LRU order alone.

    A parked session is read through a resident copy; the stored record stays parked. A
    concurrent `get` may unpark the stored record (releasing its parked bytes) between the
    peek and the read: the read then starts again from the record that replaced it.

    Raises:
        SessionStateLostError: if the session is not held.

    >>> from sessionstate import SessionState
    >>> m = SessionStateManager[SessionState]()
    >>> m.put("a", SessionState())
    >>> resident(m, "a", str).parked, m.stats()["hits"]
    ((), 0)
    """
    while True:
        state = manager.peek(session_id)
        if state is None:
            raise SessionStateLostError(unknown(session_id))
        try:
            return state.unpark()
        except (RuntimeError, OSError):
            if manager.peek(session_id) is state:  # nobody replaced it: a real failure
                raise
