"""The DreamZero-shaped streaming pipeline: one entry point, two session-state paths.

``forward(obs, session_id)`` picks the path with `resolve_session_state_config`, so the
environment variable alone flips it:

- bespoke (`BespokePath`): mutable `DreamZeroState` objects in an OrderedDict capped at
  ``MAX_DREAMZERO_SESSIONS``;
- managed (`ManagedPath`): the pure ``step(state, obs) -> (state, out)`` over an immutable
  `DreamZeroSession`, with a `SessionStateManager` holding the latest record per session.

Both paths call the same model code (`DreamZeroModel`) with the same tensors; with the flag
flipped they are bit-identical (the encoder output ring differs from the bespoke full history,
and the reader is written so that does not matter; see `DreamZeroNetworks.normalize_latents`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping

import torch

from sessionstate import (
    KVPool,
    OmniDiffusionConfig,
)
from sessionstate.models import _kit
from sessionstate.models.dreamzero._bespoke import BespokePath
from sessionstate.models.dreamzero._managed import ManagedPath
from sessionstate.models.dreamzero._model import DreamZeroModel, DreamZeroOutput
from sessionstate.models.dreamzero.config import MAX_DREAMZERO_SESSIONS, DreamZeroConfig
from sessionstate.models.dreamzero.networks import DreamZeroNetworks
from sessionstate.models.dreamzero.state import DreamZeroSession, DreamZeroState, new_session
from sessionstate.models.dreamzero.transform import Observation

__all__ = ["DreamZeroOutput", "DreamZeroPipeline"]


class DreamZeroPipeline(_kit.TwoPathPipeline[DreamZeroSession]):
    """A DreamZero-shaped streaming world model over many interleaved sessions.

    Args:
        config: A deploy config (its ``model`` section holds the DreamZero settings) or a
            `DreamZeroConfig` directly (the manager flag then comes from the environment).
        device: Where the networks and per-step tensors live. ``meta`` computes shapes and
            byte counts without allocating.
        environ: The environment to resolve the flag from; ``os.environ`` when None.
        host_device: Where accumulated video latents are kept (the host, as upstream).
        max_bespoke_sessions: The bespoke path's cap. Upstream it is the fixed constant
            `MAX_DREAMZERO_SESSIONS`; tests lower it to exercise eviction on both paths.

    What a new session does at the cap (``on_full``: evict the least recently used session,
    or refuse the new one with `SessionAdmissionError`) comes from the deploy config's
    ``session_state_on_full`` and ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL``, and is the
    same on both paths. The first eviction logs a warning naming the evicted session.

    >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    >>> from sessionstate.models.dreamzero.episode import scripted_episode
    >>> cfg = DreamZeroConfig.preset("tiny")
    >>> pipe = DreamZeroPipeline(cfg, environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"})
    >>> for sid, obs in scripted_episode(cfg, steps=3, sessions=1, seed=0):
    ...     out = pipe.forward(obs, sid)
    >>> pipe.managed, tuple(out.actions.shape), pipe.stats()["sessions"]
    (True, (4, 8), 1)
    """

    def __init__(
        self,
        config: OmniDiffusionConfig | DreamZeroConfig,
        *,
        device: torch.device | str = "cpu",
        environ: Mapping[str, str] | None = None,
        host_device: torch.device | str = "cpu",
        max_bespoke_sessions: int = MAX_DREAMZERO_SESSIONS,
    ) -> None:
        _kit.check_bespoke_cap(max_bespoke_sessions, MAX_DREAMZERO_SESSIONS)
        self.cfg, self.settings = _kit.resolve_model(
            config, DreamZeroConfig, DreamZeroConfig.from_dict, environ
        )
        self.device = torch.device(device)
        self.host_device = torch.device(host_device)
        self._model = DreamZeroModel(self.cfg, self.device, self.host_device)
        self._states: OrderedDict[Hashable, DreamZeroState] | None = None
        self._managed: ManagedPath | None = None
        self._path: ManagedPath | BespokePath
        if self.settings.enabled:
            self._path = self._managed = ManagedPath(self._model, self.settings)
        else:
            self._path = BespokePath(self._model, max_bespoke_sessions, self.settings.on_full)
            self._states = self._path.table.states

    @property
    def nets(self) -> DreamZeroNetworks:
        """The networks both paths call; assignable (a benchmark swaps in a replay)."""
        return self._model.nets

    @nets.setter
    def nets(self, nets: DreamZeroNetworks) -> None:
        self._model.nets = nets

    @property
    def kv_pool(self) -> KVPool | None:
        """The managed path's engine-owned KV pool; None on the bespoke path."""
        return None if self._managed is None else self._managed.kv_pool

    # -- entry point ---------------------------------------------------------------------------

    def forward(
        self, obs: Observation, session_id: Hashable = "default", *, begin: bool | None = None
    ) -> DreamZeroOutput:
        """Run one streaming step of ``session_id`` on ``obs``.

        Args:
            obs: The observation of this step.
            session_id: The session to step: any hashable value, as a dict key.
            begin: ``True`` starts the session, or restarts it from scratch if it is held;
                ``False`` continues it and never starts one; ``None`` (default) continues a
                held session and starts one that is not.

        Raises:
            SessionStateLostError: if ``begin=False`` and the session is not held (never
                started, dropped or evicted); nothing is created.
            SessionAdmissionError: if the session is new, the cap is reached and
                ``on_full`` is ``"refuse"``; nothing is stored or evicted.

        >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
        >>> from sessionstate.models.dreamzero.episode import scripted_episode
        >>> cfg = DreamZeroConfig.preset("tiny")
        >>> pipe = DreamZeroPipeline(cfg)
        >>> (sid, first), (_, second) = scripted_episode(cfg, steps=2, sessions=1, seed=0)
        >>> pipe.forward(first, sid, begin=True).reset
        'session'
        >>> pipe.forward(second, sid, begin=False).reset is None
        True
        """
        _kit.check_session_id(session_id)
        return self._path.forward(obs, session_id, begin)

    def new_session(self) -> DreamZeroSession:
        """An empty managed session for this pipeline's geometry."""
        return new_session(self.cfg)

    def step(
        self, state: DreamZeroSession, obs: Observation
    ) -> tuple[DreamZeroSession, DreamZeroOutput]:
        """``step(state, obs) -> (state, out)``: pure; ``state`` is left unchanged.

        The managed path's step (see `ManagedPath.step`); a bespoke pipeline has none.
        """
        assert self._managed is not None, "`step` runs on the managed path only"
        return self._managed.step(state, obs)

    def prefetch(self, session_id: Hashable, *, make_room: bool = False) -> bool:
        """Start unparking ``session_id`` in the background; return whether it started.

        For a scheduler that knows which session steps next: call it before the current
        step, and the next step's read waits only for what is left of the copy (see
        `SessionStateManager.prefetch`; the bytes are charged to the budget meanwhile).
        Outputs are bit-identical with or without it. The KV pool must have free blocks for
        the session's window and for what the step running meanwhile can take, else the
        prefetch is not started (with ``make_room``, other sessions' KV is parked first).
        False on the bespoke path, for a session not held or not parked, and for one that
        does not fit.

        >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
        >>> DreamZeroPipeline(DreamZeroConfig.preset("tiny")).prefetch("a")
        False
        """
        managed = self._managed
        if managed is None:
            _kit.check_session_id(session_id)
            return False
        return _kit.prefetch(managed.manager, session_id, make_room=make_room)

    def clear_accumulated_video_latents(self, session_id: Hashable) -> None:
        """Empty the session's accumulated video latents, for a caller that exported them.

        Keeps everything else: the VAE stream, the conditioning, the counters. The session is
        marked most recently used, on either path.

        Raises:
            SessionStateLostError: if the session is not held; nothing is created.

        >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
        >>> from sessionstate.models.dreamzero.episode import scripted_episode
        >>> cfg = DreamZeroConfig.preset("tiny")
        >>> pipe = DreamZeroPipeline(cfg)
        >>> for sid, obs in scripted_episode(cfg, steps=2, sessions=1, seed=0):
        ...     _ = pipe.forward(obs, sid)
        >>> pipe.clear_accumulated_video_latents(sid)
        >>> pipe.video_latents(sid) is None, pipe.session_values(sid)["call_count"]
        (True, 2)
        """
        _kit.check_session_id(session_id)
        self._path.clear_accumulated_video_latents(session_id)

    def decode_video(self, session_id: Hashable) -> torch.Tensor | None:
        """Decode the session's accumulated latents with the Wan decoder: (1, 3, T, H, W)."""
        latents = self.video_latents(session_id)
        if latents is None:
            return None
        return self.nets.decode(latents.to(self.device))
