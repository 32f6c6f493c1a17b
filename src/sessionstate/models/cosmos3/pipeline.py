"""The Cosmos3-shaped streaming pipeline: one entry point, two session-state paths.

``forward(request, session_id)`` picks the path with `resolve_session_state_config`, so the
environment variable alone flips it:

- bespoke (`BespokePath`): mutable `Cosmos3State` objects in an OrderedDict capped at
  ``MAX_COSMOS3_SESSIONS``, and the encode-once conditioning (the reasoner's K/V of both
  guidance branches, the RoPE tables) on the transformer instance, as upstream's
  ``cached_kv`` fields. One instance serves every session, so its cache belongs to whichever
  session wrote it last. With ``bespoke_session_keyed=True`` (the default) the cache remembers
  that session's id and a step of any other session drops and re-encodes it: correct, but
  interleaved sessions re-encode on every switch. With ``bespoke_session_keyed=False`` the
  cache is dropped only when a session resets (a new or changed prompt), so a session that
  continues after another one ran reads the other session's K/V: the interleaving hazard.
- managed (`ManagedPath`): the pure ``step(state, request) -> (state, out)`` over an immutable
  `Cosmos3Session`, whose `EncodeOnceKV` is encoded once per session (layer by layer, staged,
  read back by the step's own denoising loop, committed when the step succeeded).

Both paths call the same model code (`Cosmos3Model`) with the same tensors; with the flag
flipped (and the bespoke cache keyed) they are bit-identical.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from sessionstate import (
    KVPair,
    OmniDiffusionConfig,
)
from sessionstate.models import _kit
from sessionstate.models.cosmos3._bespoke import BespokePath, instance_cache
from sessionstate.models.cosmos3._managed import ManagedPath
from sessionstate.models.cosmos3._model import Cosmos3Model, Cosmos3Output, Cosmos3Request
from sessionstate.models.cosmos3.config import MAX_COSMOS3_SESSIONS, Cosmos3Config
from sessionstate.models.cosmos3.networks import Cosmos3Networks
from sessionstate.models.cosmos3.state import Cosmos3Session, new_session

__all__ = ["Cosmos3Output", "Cosmos3Pipeline", "Cosmos3Request"]


class Cosmos3Pipeline(_kit.TwoPathPipeline[Cosmos3Session]):
    """A Cosmos3-shaped streaming world model over many interleaved sessions.

    Args:
        config: A deploy config (its ``model`` section holds the Cosmos3 settings) or a
            `Cosmos3Config` directly (the manager flag then comes from the environment).
        device: Where the networks and per-step tensors live. ``meta`` computes shapes and
            byte counts without allocating.
        environ: The environment to resolve the flag from; ``os.environ`` when None.
        host_device: Where accumulated video latents are kept.
        max_bespoke_sessions: The bespoke path's cap (`MAX_COSMOS3_SESSIONS` upstream).
        bespoke_session_keyed: Whether the bespoke path's instance cache remembers the session
            it was encoded for and re-encodes for any other (see the module docs).

    >>> import torch
    >>> from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline, Cosmos3Request
    >>> cfg = Cosmos3Config.preset("tiny")
    >>> pipe = Cosmos3Pipeline(cfg, environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"})
    >>> out = pipe.forward(Cosmos3Request("a red car", torch.zeros(4)), "cam-0")
    >>> pipe.managed, tuple(out.video_latents.shape), out.reset
    (True, (1, 4, 2, 4, 4), 'session')

    Every session-state setting holds on both paths alike: what a new session does at the cap
    (``on_full``: evict the least recently used session, or refuse the new one with
    `SessionAdmissionError`), from the deploy config's ``session_state_on_full`` and
    ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL``; the first eviction logs a warning naming
    the evicted session. The managed path also honours the byte budget, the park tier and the
    spool directory.
    """

    def __init__(
        self,
        config: OmniDiffusionConfig | Cosmos3Config,
        *,
        device: torch.device | str = "cpu",
        environ: Mapping[str, str] | None = None,
        host_device: torch.device | str = "cpu",
        max_bespoke_sessions: int = MAX_COSMOS3_SESSIONS,
        bespoke_session_keyed: bool = True,
    ) -> None:
        _kit.check_bespoke_cap(max_bespoke_sessions, MAX_COSMOS3_SESSIONS)
        self.cfg, self.settings = _kit.resolve_model(
            config, Cosmos3Config, Cosmos3Config.from_dict, environ
        )
        self.device = torch.device(device)
        self.host_device = torch.device(host_device)
        self._model = Cosmos3Model(self.cfg, self.device, self.host_device)
        self._managed: ManagedPath | None = None
        self._bespoke: BespokePath | None = None
        self._path: ManagedPath | BespokePath
        # Kept for the managed path, where it has no effect.
        self._bespoke_session_keyed = bespoke_session_keyed
        if self.settings.enabled:
            self._path = self._managed = ManagedPath(self._model, self.settings)
        else:
            self._path = self._bespoke = BespokePath(
                self._model,
                max_bespoke_sessions,
                self.settings.on_full,
                session_keyed=bespoke_session_keyed,
            )

    @property
    def nets(self) -> Cosmos3Networks:
        """The networks both paths call; assignable."""
        return self._model.nets

    @nets.setter
    def nets(self, nets: Cosmos3Networks) -> None:
        self._model.nets = nets

    @property
    def encodes(self) -> int:
        """Prompt encodings run so far (one per branch encoded), on either path."""
        return self._model.encodes

    @encodes.setter
    def encodes(self, encodes: int) -> None:
        self._model.encodes = encodes

    @property
    def bespoke_session_keyed(self) -> bool:
        """Whether the bespoke instance cache is keyed by session (see the module docs).

        Assignable; it has no effect on the managed path.
        """
        if self._bespoke is None:
            return self._bespoke_session_keyed
        return self._bespoke.session_keyed

    @bespoke_session_keyed.setter
    def bespoke_session_keyed(self, keyed: bool) -> None:
        if self._bespoke is None:
            self._bespoke_session_keyed = keyed
        else:
            self._bespoke.session_keyed = keyed

    # -- entry point ---------------------------------------------------------------------------

    def forward(
        self,
        request: Cosmos3Request,
        session_id: Hashable = "default",
        *,
        begin: bool | None = None,
    ) -> Cosmos3Output:
        """Run one streaming step (one generated chunk) of ``session_id``.

        Args:
            request: The prompts and control of this step.
            session_id: The session to step: any hashable value, as a dict key.
            begin: ``True`` starts the session, or restarts it from scratch if it is held;
                ``False`` continues it and never starts one; ``None`` (default) continues a
                held session and starts one that is not.

        Raises:
            SessionStateLostError: if ``begin=False`` and the session is not held (never
                started, dropped or evicted); nothing is created.
            SessionAdmissionError: if the session is new, the cap is reached and
                ``on_full`` is ``"refuse"``; nothing is stored or evicted.

        >>> import torch
        >>> from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline, Cosmos3Request
        >>> pipe = Cosmos3Pipeline(Cosmos3Config.preset("tiny"))
        >>> request = Cosmos3Request("a red car", torch.zeros(4))
        >>> pipe.forward(request, "cam-0", begin=True).reset
        'session'
        >>> pipe.forward(request, "cam-0", begin=False).reset is None
        True
        """
        _kit.check_session_id(session_id)
        return self._path.forward(request, session_id, begin)

    def new_session(self) -> Cosmos3Session:
        """An empty managed session for this pipeline's geometry."""
        return new_session(self.cfg)

    def step(
        self, state: Cosmos3Session, request: Cosmos3Request
    ) -> tuple[Cosmos3Session, Cosmos3Output]:
        """``step(state, request) -> (state, out)``: pure; ``state`` is left unchanged.

        The managed path's step (see `ManagedPath.step`); a bespoke pipeline has none.
        """
        assert self._managed is not None, "`step` runs on the managed path only"
        return self._managed.step(state, request)

    def prefetch(self, session_id: Hashable, *, make_room: bool = False) -> bool:
        """Start unparking ``session_id`` in the background; return whether it started.

        For a scheduler that knows which session steps next: call it before the current
        step, and the next step's read waits only for what is left of the copy (its parked
        `EncodeOnceKV` and buffers; see `SessionStateManager.prefetch`, the bytes are charged
        to the budget meanwhile). Outputs are bit-identical with or without it. With
        ``make_room``, other sessions are parked to fit it. False on the bespoke path, for a
        session not held or not parked, and for one that does not fit.

        >>> from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline
        >>> Cosmos3Pipeline(Cosmos3Config.preset("tiny")).prefetch("a")
        False
        """
        managed = self._managed
        return _kit.prefetch(
            None if managed is None else managed.manager, session_id, make_room=make_room
        )

    def instance_cache(self) -> tuple[dict[str, KVPair], ...]:
        """The bespoke path's K/V cache: every block's ``cached_kv``, in layer order."""
        return instance_cache(self.nets.transformer)
