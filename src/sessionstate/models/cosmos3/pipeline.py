"""The Cosmos3-shaped streaming pipeline: one entry point, two session-state paths.

``forward(request, session_id)`` picks the path with `resolve_session_state_config`, so the
environment variable alone flips it:

- bespoke: mutable `Cosmos3State` objects in an OrderedDict capped at
  ``MAX_COSMOS3_SESSIONS``, and the encode-once conditioning (the reasoner's K/V of both
  guidance branches, the RoPE tables) on the transformer instance, as upstream's
  ``cached_kv`` fields. One instance serves every session, so its cache belongs to whichever
  session wrote it last. With ``bespoke_session_keyed=True`` (the default) the cache remembers
  that session's id and a step of any other session drops and re-encodes it: correct, but
  interleaved sessions re-encode on every switch. With ``bespoke_session_keyed=False`` the
  cache is dropped only when a session resets (a new or changed prompt), so a session that
  continues after another one ran reads the other session's K/V: the interleaving hazard.
- managed: the pure ``step(state, request) -> (state, out)`` over an immutable
  `Cosmos3Session`, whose `EncodeOnceKV` is encoded once per session (layer by layer, staged,
  read back by the step's own denoising loop, committed when the step succeeded).

Both paths call the same networks with the same tensors; with the flag flipped (and the
bespoke cache keyed) they are bit-identical.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence

import attrs
import torch

from sessionstate import (
    KVPair,
    LatentBuffer,
    MissingKeyError,
    OmniDiffusionConfig,
    SessionStateManager,
    SessionStateSettings,
    nbytes_by_device,
    resolve_session_state_config,
)
from sessionstate._checks import is_int
from sessionstate._manager import check_session_id  # the manager's session-id rule
from sessionstate.models.cosmos3.config import MAX_COSMOS3_SESSIONS, Cosmos3Config
from sessionstate.models.cosmos3.networks import (
    Cosmos3Networks,
    GenerationBlock,
    build_networks,
)
from sessionstate.models.cosmos3.state import (
    BRANCHES,
    Cosmos3Session,
    Cosmos3State,
    new_session,
)

__all__ = ["Cosmos3Output", "Cosmos3Pipeline", "Cosmos3Request"]

KVSource = Callable[[str], Sequence[KVPair]]


@attrs.frozen(eq=False)
class Cosmos3Request:
    """One streaming step's input: the prompts and a control vector (e.g. a camera action)."""

    prompt: str
    control: torch.Tensor
    negative_prompt: str = ""


@attrs.frozen(eq=False)
class Cosmos3Output:
    """What one forward returns: the chunk's latents, and ``"session"`` if it reset."""

    video_latents: torch.Tensor
    reset: str | None


def _unknown_session(session_id: Hashable) -> str:
    return (
        f"Cosmos3 session {session_id!r} is not held (never started, dropped or evicted); "
        "call `forward(request, session_id)` to start it."
    )


def _prompt_changed(
    held: torch.Tensor | None,
    held_negative: torch.Tensor | None,
    tokens: torch.Tensor,
    neg: torch.Tensor,
) -> bool:
    if held is None or held_negative is None:
        return True
    return not (torch.equal(held, tokens) and torch.equal(held_negative, neg))


class Cosmos3Pipeline:
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
        if not is_int(max_bespoke_sessions) or max_bespoke_sessions <= 0:
            msg = (
                f"`max_bespoke_sessions` must be a positive int, got {max_bespoke_sessions!r}; "
                f"the bespoke path's cap is {MAX_COSMOS3_SESSIONS} upstream."
            )
            raise ValueError(msg)
        if isinstance(config, Cosmos3Config):
            self.cfg = config
            self.settings: SessionStateSettings = resolve_session_state_config(None, environ)
        else:
            self.cfg = Cosmos3Config.from_dict(config.model)
            self.settings = resolve_session_state_config(config, environ)
        self.device = torch.device(device)
        self.host_device = torch.device(host_device)
        self.nets: Cosmos3Networks = build_networks(self.cfg, self.device)
        self.encodes = 0
        """Prompt encodings run so far (one per branch encoded), on either path."""
        self.manager: SessionStateManager[Cosmos3Session] | None = None
        self._states: OrderedDict[Hashable, Cosmos3State] | None = None
        if self.settings.enabled:
            self.manager = SessionStateManager[Cosmos3Session](
                self.settings.max_sessions, check_immutable=self.settings.check_immutable
            )
        else:
            self._states = OrderedDict()
            self._max_bespoke_sessions = max_bespoke_sessions
            self._bespoke_counts = {"hits": 0, "misses": 0, "evictions": 0}
            self.bespoke_session_keyed = bespoke_session_keyed

    @property
    def managed(self) -> bool:
        """Whether this pipeline runs the manager-backed path."""
        return self.manager is not None

    # -- entry point ---------------------------------------------------------------------------

    def forward(self, request: Cosmos3Request, session_id: Hashable = "default") -> Cosmos3Output:
        """Run one streaming step (one generated chunk) of ``session_id`` (any hashable value)."""
        check_session_id(session_id)
        if self.manager is not None:
            state = self.manager.get(session_id)
            if state is None:
                state = self.new_session()
            state, out = self.step(state, request)
            # Published only after the whole step succeeded.
            self.manager.put(session_id, state)
            return out
        return self._bespoke_forward(session_id, request)

    def new_session(self) -> Cosmos3Session:
        """An empty managed session for this pipeline's geometry."""
        return new_session(self.cfg)

    def drop_session(self, session_id: Hashable) -> bool:
        """End a session on either path; returns whether it was held."""
        if self.manager is not None:
            return self.manager.drop(session_id)
        assert self._states is not None
        return self._states.pop(session_id, None) is not None

    def session_ids(self) -> list[Hashable]:
        """Retained sessions, least recently used first."""
        if self.manager is not None:
            return self.manager.session_ids()
        assert self._states is not None
        return list(self._states)

    def session_values(self, session_id: Hashable) -> dict[str, object]:
        """Every value the session holds or reads, by name (without touching LRU order).

        On the bespoke path ``text_kv`` and ``rope_freqs`` are the transformer instance's
        cache (shared by every session: what the next step of any session would read).
        """
        if self.manager is not None:
            state = self.manager.peek(session_id)
            if state is None:
                raise MissingKeyError(_unknown_session(session_id))
            return state.values()
        assert self._states is not None
        if session_id not in self._states:
            raise MissingKeyError(_unknown_session(session_id))
        s = self._states[session_id]
        return {
            "text_kv": self.instance_cache(),
            "context_latents": tuple(s.context_latents),
            "video_latents": tuple(s.video_latents),
            "rope_freqs": self.nets.transformer.cached_rope,
            "prompt_tokens": s.prompt_tokens,
            "negative_tokens": s.negative_tokens,
            "chunk_count": s.chunk_count,
        }

    def instance_cache(self) -> tuple[dict[str, KVPair], ...]:
        """The bespoke path's K/V cache: every block's ``cached_kv``, in layer order."""
        blocks = self.nets.transformer.blocks
        return tuple(dict(b.cached_kv) for b in blocks if isinstance(b, GenerationBlock))

    def video_latents(self, session_id: Hashable) -> torch.Tensor | None:
        """Every chunk generated for the session, joined along time (None if none)."""
        latents = self.session_values(session_id)["video_latents"]
        chunks = latents.view() if isinstance(latents, LatentBuffer) else latents
        assert isinstance(chunks, tuple)
        return torch.cat(chunks, dim=2) if chunks else None

    def stats(self) -> dict[str, int]:
        """The manager's `stats()`; on the bespoke path, the same keys computed by hand
        (the sessions' values plus the instance's cache, each storage once)."""
        if self.manager is not None:
            return self.manager.stats()
        assert self._states is not None
        held = [self.session_values(sid) for sid in self._states]
        totals = nbytes_by_device(held) if held else {}
        out = {
            "sessions": len(self._states),
            "max_sessions": self._max_bespoke_sessions,
            **self._bespoke_counts,
        }
        out["total_nbytes"] = sum(totals.values())
        out.update({f"nbytes:{d}": n for d, n in sorted(totals.items())})
        return out

    # -- both paths ------------------------------------------------------------------------------

    def _denoise(
        self,
        chunk_index: int,
        context: torch.Tensor,
        control: torch.Tensor,
        rope: torch.Tensor,
        kv_for: KVSource,
    ) -> torch.Tensor:
        """Denoise one chunk with guidance; ``kv_for(branch)`` supplies each branch's K/V."""
        nets = self.nets
        latents = nets.noise(chunk_index)
        control = control.to(device=self.device, dtype=nets.dtype)
        for sigma, sigma_next in zip(nets.sigmas[:-1], nets.sigmas[1:], strict=True):
            cond, uncond = kv_for("cond"), kv_for("uncond")
            v = nets.guided_velocity(latents, sigma, context, control, rope, cond, uncond)
            latents = latents + (sigma_next - sigma) * v
        return latents

    def _texts(self, request: Cosmos3Request) -> dict[str, torch.Tensor]:
        return {
            "cond": self.nets.tokenize(request.prompt),
            "uncond": self.nets.tokenize(request.negative_prompt),
        }

    # -- managed path: a pure step ---------------------------------------------------------------

    def step(
        self, state: Cosmos3Session, request: Cosmos3Request
    ) -> tuple[Cosmos3Session, Cosmos3Output]:
        """``step(state, request) -> (state, out)``: pure; ``state`` is left unchanged.

        The K/V is encoded on the session's first denoising step, one layer at a time, and
        staged; the step's own later denoising steps read it back with
        ``include_staged=True``; it is committed only once the chunk is generated.
        """
        nets, cfg = self.nets, self.cfg
        texts = self._texts(request)
        reason = None
        if _prompt_changed(
            state.prompt_tokens, state.negative_tokens, texts["cond"], texts["uncond"]
        ):
            reason = "session"
            state = self.new_session()
        state = state.with_attrs(prompt_tokens=texts["cond"], negative_tokens=texts["uncond"])
        if state.rope_freqs is None:
            state = state.with_attrs(rope_freqs=nets.rope())
        rope = state.rope_freqs
        assert rope is not None

        kv = state.text_kv
        if not kv.is_allocated:  # evicted: the prompt tokens are the recompute source
            kv = kv.allocate(num_layers=cfg.num_layers, branches=BRANCHES)

        def kv_for(branch: str) -> Sequence[KVPair]:
            nonlocal kv
            if kv.missing_layers(branch, include_staged=True):
                self.encodes += 1
                for i, pair in enumerate(nets.encode_layers(texts[branch])):
                    kv = kv.stage({branch: {i: pair}})
            pairs: tuple[KVPair, ...] = kv.view(branch, include_staged=True)
            return pairs

        ring = state.context_latents
        context = ring.concat() if len(ring) else nets.empty_context()
        latents = self._denoise(state.chunk_count, context, request.control, rope, kv_for)
        if kv.has_staged:
            kv = kv.commit()
        state = state.with_object("text_kv", kv)
        state = state.update_object("context_latents", lambda b: b.commit(latents))
        host = latents.detach().to(self.host_device, copy=True)
        state = state.update_object("video_latents", lambda b: b.commit(host))
        state = state.with_attrs(chunk_count=state.chunk_count + 1)
        return state, Cosmos3Output(video_latents=latents, reset=reason)

    # -- bespoke path: mutable, in place, cache on the instance ------------------------------------

    def _bespoke_state(self, session_id: Hashable) -> Cosmos3State:
        assert self._states is not None
        state = self._states.get(session_id)
        if state is None:
            self._bespoke_counts["misses"] += 1
            state = Cosmos3State(self.cfg.context_chunks)
            self._states[session_id] = state
            if len(self._states) > self._max_bespoke_sessions:
                self._states.popitem(last=False)
                self._bespoke_counts["evictions"] += 1
        else:
            self._bespoke_counts["hits"] += 1
            self._states.move_to_end(session_id)
        return state

    def _bespoke_forward(self, session_id: Hashable, request: Cosmos3Request) -> Cosmos3Output:
        nets = self.nets
        tr = nets.transformer
        state = self._bespoke_state(session_id)
        texts = self._texts(request)
        if self.bespoke_session_keyed and tr.cached_kv_key != session_id:
            tr.clear_cached_kv()
            tr.cached_kv_key = session_id
        reason = None
        if _prompt_changed(
            state.prompt_tokens, state.negative_tokens, texts["cond"], texts["uncond"]
        ):
            reason = "session"
            state.reset()
            tr.clear_cached_kv()
        state.prompt_tokens, state.negative_tokens = texts["cond"], texts["uncond"]
        if tr.cached_rope is None:
            tr.cached_rope = nets.rope()

        def kv_for(branch: str) -> Sequence[KVPair]:
            blocks = [b for b in tr.blocks if isinstance(b, GenerationBlock)]
            if any(branch not in b.cached_kv for b in blocks):
                self.encodes += 1
                for block, pair in zip(blocks, nets.encode_layers(texts[branch]), strict=True):
                    block.cached_kv.setdefault(branch, pair)
            return [b.cached_kv[branch] for b in blocks]

        ctx = state.context_latents
        context = torch.cat(list(ctx), dim=2) if ctx else nets.empty_context()
        latents = self._denoise(state.chunk_count, context, request.control, tr.cached_rope, kv_for)
        state.context_latents.append(latents)
        state.video_latents.append(latents.detach().to(self.host_device, copy=True))
        state.chunk_count += 1
        return Cosmos3Output(video_latents=latents, reset=reason)
