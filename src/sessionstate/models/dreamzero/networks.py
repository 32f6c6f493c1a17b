"""The networks: diffusers' real Wan VAE (seeded weights) and small seeded stand-ins.

Every function here is a pure function of its tensor arguments and the (frozen) weights: the
Wan encoder's causal-conv feature cache is passed in and handed back, never left on the
module, so one VAE serves any number of interleaved sessions. Both session-state paths call
exactly these functions; they differ only in how they keep state between calls.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
from torch import nn

from sessionstate import RandomKey
from sessionstate.models.dreamzero.config import _MASK_CHANNELS, DreamZeroConfig

__all__ = [
    "DreamZeroNetworks",
    "FeatMap",
    "Noise",
    "build_networks",
]

FeatMap = tuple[torch.Tensor | None, ...]
"""A Wan causal-conv cache: one slot per causal conv (the encoder's: 24 of 26 in use)."""

Noise = tuple[torch.Tensor, torch.Tensor]
"""A block's starting noise: the video latents' and the actions' (`DreamZeroNetworks.noise`)."""


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class TextEncoder(nn.Module):
    """Stand-in for UMT5: token embedding and a projection (seeded, deterministic)."""

    def __init__(self, cfg: DreamZeroConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(257, cfg.text_dim)
        self.proj = nn.Linear(cfg.text_dim, cfg.text_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded: torch.Tensor = self.proj(self.embed(tokens))
        return torch.tanh(embedded)


class ImageEncoder(nn.Module):
    """Stand-in for CLIP: a grid of pooled patches plus a global token, projected."""

    def __init__(self, cfg: DreamZeroConfig) -> None:
        super().__init__()
        self.grid = cfg.clip_grid
        self.proj = nn.Linear(3, cfg.clip_dim)

    def forward(self, frame: torch.Tensor) -> torch.Tensor:
        # frame: (1, 3, H, W) in [-1, 1] -> (1, grid * grid + 1, clip_dim)
        patches = nn.functional.adaptive_avg_pool2d(frame, self.grid).flatten(2).transpose(1, 2)
        tokens = torch.cat([patches.mean(dim=1, keepdim=True), patches], dim=1)
        projected: torch.Tensor = self.proj(tokens)
        return projected


class Denoiser(nn.Module):
    """Stand-in for the AR diffusion transformer: predicts video and action flow velocities.

    Conditioned on the reference latents (the window's start frame or the newest observed
    latent frames), the ``ys`` slice, CLIP features, prompt embeddings and the timestep, and
    attending over the window's KV cache: ``kv_layers`` attention layers whose queries are
    2x2 patches of the noisy latents and whose keys and values were prefilled from the
    window's clean reference latents, the current block's included (causal over blocks).
    """

    def __init__(self, cfg: DreamZeroConfig) -> None:
        super().__init__()
        z, h = cfg.vae_z_dim, cfg.hidden_dim
        self.inp = nn.Conv3d(z + z + _MASK_CHANNELS + z, h, kernel_size=1)
        self.text = nn.Linear(cfg.text_dim, h)
        self.clip = nn.Linear(cfg.clip_dim, h)
        self.time = nn.Linear(1, h)
        self.out = nn.Conv3d(h, z, kernel_size=1)
        self.action_in = nn.Linear(cfg.action_dim, h)
        self.action_out = nn.Linear(h, cfg.action_dim)
        self.kv_token_shape = cfg.kv_token_shape
        heads_dim = cfg.kv_heads * cfg.kv_head_dim
        self.kv_proj = nn.Linear(z, cfg.kv_layers * 2 * heads_dim)
        self.q_proj = nn.Linear(h, heads_dim)
        self.o_proj = nn.Linear(heads_dim, h)

    def prefill(self, ref: torch.Tensor) -> torch.Tensor:
        """KV of clean latents (1, z, T, lh, lw): ``(T * frame_seqlen, layers, 2, heads, dim)``."""
        tokens = _patch_tokens(ref)
        kv: torch.Tensor = self.kv_proj(tokens)
        return kv.view(tokens.shape[0], *self.kv_token_shape)

    def attend(self, hidden: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Hidden (1, h, T, lh, lw) plus what its patches read from ``kv``, layer by layer."""
        layers, _, heads, dim = self.kv_token_shape
        x = _patch_tokens(hidden)
        start = x
        for layer in range(layers):
            q = self.q_proj(x).view(-1, heads, dim).transpose(0, 1)
            k = kv[:, layer, 0].transpose(0, 1)
            v = kv[:, layer, 1].transpose(0, 1)
            read = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            x = x + self.o_proj(read.transpose(0, 1).reshape(x.shape[0], heads * dim))
        _, h, t, lh, lw = hidden.shape
        delta = (x - start).transpose(0, 1).reshape(1, h, t, lh // 2, lw // 2)
        up = delta.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)
        return hidden + up

    def forward_batch(
        self,
        latents: torch.Tensor,
        actions: torch.Tensor,
        t: torch.Tensor,
        ref: torch.Tensor,
        ys: torch.Tensor,
        clip_feas: torch.Tensor,
        prompt_embeds: torch.Tensor,
        kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` over a batch: every argument with a leading batch dimension B (``kv``
        ``(B, tokens, *kv_token_shape)``), the same arithmetic per session.

        A separate method so that `forward`, the one-session step both paths run, keeps its
        kernels (and so its bits) exactly; batched kernels round differently.
        """
        b = latents.shape[0]
        ref_b = ref.mean(dim=2, keepdim=True).expand_as(latents)
        x = self.inp(torch.cat([latents, ref_b, ys], dim=1))
        cond = (
            self.text(prompt_embeds.mean(dim=1))
            + self.clip(clip_feas.mean(dim=1))
            + self.time(t.reshape(1, 1).to(latents.dtype) / 1000)
        )
        hidden = torch.nn.functional.silu(x + cond[:, :, None, None, None])
        layers, _, heads, dim = self.kv_token_shape
        tokens = _patch_tokens_batch(hidden)
        start = tokens
        for layer in range(layers):
            q = self.q_proj(tokens).view(b, -1, heads, dim).transpose(1, 2)
            k = kv[:, :, layer, 0].transpose(1, 2)
            v = kv[:, :, layer, 1].transpose(1, 2)
            read = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            tokens = tokens + self.o_proj(read.transpose(1, 2).reshape(b, -1, heads * dim))
        _, h, t_, lh, lw = hidden.shape
        delta = (tokens - start).transpose(1, 2).reshape(b, h, t_, lh // 2, lw // 2)
        hidden = hidden + delta.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)
        video = self.out(hidden)
        pooled = hidden.mean(dim=(2, 3, 4))
        act = self.action_out(torch.nn.functional.silu(self.action_in(actions) + pooled[:, None]))
        return video, act

    def forward(
        self,
        latents: torch.Tensor,
        actions: torch.Tensor,
        t: torch.Tensor,
        ref: torch.Tensor,
        ys: torch.Tensor,
        clip_feas: torch.Tensor,
        prompt_embeds: torch.Tensor,
        kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ref_b = ref.mean(dim=2, keepdim=True).expand_as(latents)
        x = self.inp(torch.cat([latents, ref_b, ys], dim=1))
        cond = (
            self.text(prompt_embeds.mean(dim=1))
            + self.clip(clip_feas.mean(dim=1))
            + self.time(t.reshape(1, 1).to(latents.dtype) / 1000)
        )
        hidden = torch.nn.functional.silu(x + cond[:, :, None, None, None])
        hidden = self.attend(hidden, kv)
        video = self.out(hidden)
        pooled = hidden.mean(dim=(2, 3, 4))
        act = self.action_out(torch.nn.functional.silu(self.action_in(actions) + pooled[:, None]))
        return video, act


class DreamZeroNetworks:
    """All networks of the pipeline, built once per process and shared by every session.

    Build it with `build_networks`. All methods are pure: they read weights and arguments
    and write nothing that outlives the call.
    """

    def __init__(self, cfg: DreamZeroConfig, device: torch.device | str) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        # Seeded weights without disturbing the caller's random state, CUDA's included.
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(cfg.seed)
            with _default_dtype(self.dtype), torch.device(self.device):
                self.vae = AutoencoderKLWan(base_dim=cfg.vae_base_dim, z_dim=cfg.vae_z_dim)
                self.text_encoder = TextEncoder(cfg)
                self.image_encoder = ImageEncoder(cfg)
                self.denoiser = Denoiser(cfg)
                self.action_q01 = -1.0 - torch.rand(cfg.action_dim)
                self.action_q99 = 1.0 + torch.rand(cfg.action_dim)
        for module in (self.vae, self.text_encoder, self.image_encoder, self.denoiser):
            module.eval().requires_grad_(False)
            if self.dtype in _NO_FAST_CPU_CONV:
                for conv in module.modules():
                    if isinstance(conv, (nn.Conv2d, nn.Conv3d)):
                        conv._conv_forward = _Float32OnCPU(conv)  # type: ignore[method-assign,assignment]
        z = cfg.vae_z_dim
        mean = torch.tensor(self.vae.config.latents_mean[:z], dtype=self.dtype)
        std = torch.tensor(self.vae.config.latents_std[:z], dtype=self.dtype)
        self.latents_mean = mean.view(1, z, 1, 1, 1).to(self.device)
        self.latents_inv_std = (1.0 / std).view(1, z, 1, 1, 1).to(self.device)
        self.num_enc_convs = int(self.vae._cached_conv_counts["encoder"])
        self.num_dec_convs = int(self.vae._cached_conv_counts["decoder"])
        self._scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
        self._scheduler.set_timesteps(cfg.num_inference_steps, device="cpu")

    # -- text and image conditioning ---------------------------------------------------------

    def tokenize(self, prompt: str) -> torch.Tensor:
        """Byte-level token ids, padded/truncated to ``text_len``: (1, L) int64, on the host.

        Kept on the host so the reset check (a `torch.equal` against the session's prompt)
        never needs a device sync.
        """
        ids = [b + 1 for b in prompt.encode("utf-8")][: self.cfg.text_len]
        ids += [0] * (self.cfg.text_len - len(ids))
        return torch.tensor([ids], dtype=torch.int64)

    @torch.no_grad()
    def encode_prompt(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings (1, text_len, text_dim), on the model's device."""
        embeds: torch.Tensor = self.text_encoder(tokens.to(self.device))
        return embeds

    @torch.no_grad()
    def encode_image(self, frame: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Window-start conditioning from one pixel frame (1, 3, 1, H, W), or a batch of B.

        Returns ``(clip_feas, ys, cond_latent)``: CLIP features; the mask (4 channels) joined
        with the normalised latents of the frame followed by zero frames up to ``num_frames``;
        and the frame's own one-frame latent.
        """
        clip_feas = self.image_encoder(frame[:, :, 0])
        zeros = frame.new_zeros(
            (
                frame.shape[0],
                3,
                self.cfg.num_frames - 1,
                self.cfg.canvas_height,
                self.cfg.canvas_width,
            )
        )
        clip = torch.cat([frame, zeros], dim=2)
        feat_map = self.init_feat_map()
        outs = []
        for start, stop in _chunk_bounds(clip.shape[2]):
            out, feat_map = self.encode_chunk(clip[:, :, start:stop], feat_map)
            outs.append(out)
        latents = self.normalize_latents(outs)
        mask = torch.zeros_like(latents[:, :_MASK_CHANNELS])
        mask[:, :, :1] = 1
        ys = torch.cat([mask, latents], dim=1)
        return clip_feas, ys, latents[:, :, :1]

    # -- Wan VAE streaming encode ------------------------------------------------------------

    def init_feat_map(self) -> FeatMap:
        """An empty causal-conv cache: one None slot per encoder causal conv."""
        return (None,) * self.num_enc_convs

    @torch.no_grad()
    def encode_chunk(self, chunk: torch.Tensor, feat_map: FeatMap) -> tuple[torch.Tensor, FeatMap]:
        """Encode a pixel chunk (1 frame to seed, then 4) with the session's cache.

        Returns the pre-quant encoder output (1, 2 * z_dim, 1, h, w) and the updated cache.
        The input cache is left untouched: the encoder writes into a private list, and only
        ever replaces its slots, never writes into their tensors.
        """
        cache: list[torch.Tensor | None] = list(feat_map)
        out = self.vae.encoder(chunk, feat_cache=cache, feat_idx=[0])
        return out, tuple(cache)

    @torch.no_grad()
    def normalize_latents(self, frames: Sequence[torch.Tensor]) -> torch.Tensor:
        """``quant_conv``, ``mu`` and normalisation, one latent frame at a time, joined on T.

        ``quant_conv`` has kernel size 1, so each latent frame depends only on itself. It is
        still applied per frame, on a contiguous (1, C, 1, h, w) input, because a conv over a
        long history and over a short ring is not bitwise identical on CPU: oneDNN picks its
        blocking by the input's length. The same call on the same frame is.
        """
        outs = []
        for pre in frames:
            for t in range(pre.shape[2]):
                enc = self.vae.quant_conv(pre[:, :, t : t + 1].contiguous())
                mu = enc.chunk(2, dim=1)[0]
                outs.append((mu - self.latents_mean) * self.latents_inv_std)
        return torch.cat(outs, dim=2)

    def observation_latents(self, encoder_out: Sequence[torch.Tensor], n: int) -> torch.Tensor:
        """The last ``n`` normalised latent frames of the encoder output frames given.

        Left-pads with copies of the last frame when fewer than ``n`` exist.
        """
        latents = self.normalize_latents(encoder_out)
        have = latents.shape[2]
        if have >= n:
            return latents[:, :, have - n :]
        last = latents[:, :, -1:]
        return torch.cat([last.expand(-1, -1, n - have, -1, -1), latents], dim=2)

    # -- denoising ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill_kv(self, ref: torch.Tensor) -> torch.Tensor:
        """The KV tokens of clean reference latents, to append to the window's cache.

        Returns ``(T * frame_seqlen, layers, 2, heads, head_dim)`` for ``ref`` (1, z, T, h, w).
        """
        return self.denoiser.prefill(ref)

    def noise(self, key: RandomKey) -> tuple[Noise, RandomKey]:
        """A block's starting noise, drawn from the session's ``key``, and the next key.

        Both tensors come from one host generator seeded by the key (`RandomKey.normals`):
        the video latents' noise, then the actions'. A pure function of the key.

        >>> from sessionstate import RandomKey
        >>> from sessionstate.models.dreamzero import DreamZeroConfig
        >>> nets = build_networks(DreamZeroConfig.preset("tiny"))
        >>> (latents, actions), key = nets.noise(RandomKey.seeded(0))
        >>> tuple(latents.shape), tuple(actions.shape), key.counter
        ((1, 16, 2, 4, 8), (1, 4, 8), 1)
        """
        cfg = self.cfg
        shape = (1, cfg.vae_z_dim, cfg.num_frame_per_block, cfg.latent_height, cfg.latent_width)
        (latents, actions), key = key.normals(
            (shape, (1, cfg.action_horizon, cfg.action_dim)), dtype=self.dtype, device=self.device
        )
        return (latents, actions), key

    @torch.no_grad()
    def diffuse(
        self,
        ref: torch.Tensor,
        ys: torch.Tensor,
        clip_feas: torch.Tensor,
        prompt_embeds: torch.Tensor,
        kv: torch.Tensor,
        noise: Noise,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Denoise the next block from ``noise`` (see `noise`): (video latents, raw actions).

        ``kv`` is the window's KV cache as read for this step, ``(tokens, *kv_token_shape)``.
        """
        latents, actions = noise
        # The template holds the schedule; each branch steps its own shallow copy, whose step
        # counter starts unset. `step` only rebinds attributes, never writes into the arrays.
        video_sched = copy.copy(self._scheduler)
        action_sched = copy.copy(self._scheduler)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for t in video_sched.timesteps:
                v_video, v_action = self.denoiser(
                    latents, actions, t.to(self.device), ref, ys, clip_feas, prompt_embeds, kv
                )
                latents = video_sched.step(v_video, t, latents).prev_sample
                actions = action_sched.step(v_action, t, actions).prev_sample
        return latents, actions[0]

    @torch.no_grad()
    def diffuse_batch(
        self,
        refs: Sequence[torch.Tensor],
        ys: Sequence[torch.Tensor],
        clip_feas: Sequence[torch.Tensor],
        prompt_embeds: Sequence[torch.Tensor],
        kvs: Sequence[torch.Tensor],
        noises: Sequence[Noise],
        *,
        batch_invariant: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`diffuse` of a batch of sessions whose inputs have one shape, in one loop, each from
        its own noise (`noise`).

        Returns each session's video latents (1, z, F, h, w) and raw actions, its own
        tensors. The schedulers' updates (elementwise) run on the whole batch. With
        ``batch_invariant`` the denoiser runs once per session, as `diffuse` runs it, and
        each session's results equal its own `diffuse` bit for bit; without it the denoiser
        runs once on the batch (`Denoiser.forward_batch`).
        """
        size = len(refs)
        latents = torch.cat([n[0] for n in noises])
        actions = torch.cat([n[1] for n in noises])
        if not batch_invariant:
            ref, y, clip, prompt = (
                torch.cat(list(x)) for x in (refs, ys, clip_feas, prompt_embeds)
            )
            kv = torch.stack(list(kvs))
        video_sched = copy.copy(self._scheduler)
        action_sched = copy.copy(self._scheduler)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for t in video_sched.timesteps:
                step = t.to(self.device)
                if batch_invariant:
                    each = [
                        self.denoiser(
                            latents[i : i + 1],
                            actions[i : i + 1],
                            step,
                            refs[i],
                            ys[i],
                            clip_feas[i],
                            prompt_embeds[i],
                            kvs[i],
                        )
                        for i in range(size)
                    ]
                    v_video = torch.cat([v for v, _ in each])
                    v_action = torch.cat([a for _, a in each])
                else:
                    v_video, v_action = self.denoiser.forward_batch(
                        latents, actions, step, ref, y, clip, prompt, kv
                    )
                latents = video_sched.step(v_video, t, latents).prev_sample
                actions = action_sched.step(v_action, t, actions).prev_sample
        return (
            [latents[i : i + 1].clone() for i in range(size)],
            [actions[i].clone() for i in range(size)],
        )

    def postprocess_actions(self, actions: torch.Tensor, joint_state: torch.Tensor) -> torch.Tensor:
        """Denormalise from [-1, 1] with q01/q99; joints (first 7 dims) relative to absolute."""
        a = actions.float()
        q01, q99 = self.action_q01.float(), self.action_q99.float()
        a = (a + 1) / 2 * (q99 - q01) + q01
        absolute = a.clone()
        absolute[:, :7] = a[:, :7] + joint_state[:7].to(a)
        return absolute

    # -- Wan VAE streaming decode ------------------------------------------------------------

    def init_decode_map(self) -> FeatMap:
        """An empty decoder causal-conv cache: one None slot per decoder causal conv."""
        return (None,) * self.num_dec_convs

    @torch.no_grad()
    def decode_chunk(
        self, latents: torch.Tensor, feat_map: FeatMap
    ) -> tuple[torch.Tensor, FeatMap]:
        """Decode normalised latents (1, z, T, h, w) to pixels, continuing a session's stream.

        Frame by frame, as one call of the Wan decoder runs (`AutoencoderKLWan.decode`), with
        the cache passed in: the first latent frame of a stream (an empty cache) gives one
        pixel frame, every later one four. Returns the pixels (1, 3, F, H, W) in [-1, 1] and
        the updated cache; the input cache is left untouched (a private list, slots replaced,
        never written into). ``post_quant_conv`` (kernel size 1) runs per latent frame, so
        how a history is split into chunks never changes a bit.

        The decoder marks an upsampling slot that has seen one frame with the string
        ``"Rep"``; the returned cache holds an empty tensor there instead, so it stays a
        tree of tensors (a stream of one latent frame ends that way; any longer one never).
        """
        cache: list[Any] = [
            _REPEAT if slot is not None and slot.numel() == 0 else slot for slot in feat_map
        ]
        first = all(slot is None for slot in feat_map)
        z = latents / self.latents_inv_std + self.latents_mean
        outs = []
        for t in range(z.shape[2]):
            x = self.vae.post_quant_conv(z[:, :, t : t + 1].contiguous())
            outs.append(
                self.vae.decoder(x, feat_cache=cache, feat_idx=[0], first_chunk=first and t == 0)
            )
        frames = torch.cat(outs, dim=2).clamp(-1.0, 1.0)
        marker = latents.new_empty(0)
        return frames, tuple(marker if isinstance(slot, str) else slot for slot in cache)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode normalised latents (1, z, T, h, w) to pixels in [-1, 1] in one call.

        As `AutoencoderKLWan.decode` runs (``post_quant_conv`` over all frames, then the
        decoder frame by frame with a cache of its own), without the module's cache
        attributes, so concurrent calls share nothing. The streaming `decode_chunk` gives the
        same bits, however a history is split.
        """
        z = latents / self.latents_inv_std + self.latents_mean
        x = self.vae.post_quant_conv(z)
        cache: list[Any] = [None] * self.num_dec_convs
        outs = [
            self.vae.decoder(
                x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0)
            )
            for i in range(x.shape[2])
        ]
        return torch.cat(outs, dim=2).clamp(-1.0, 1.0)


_REPEAT = "Rep"
"""The Wan decoder's mark for an upsampling slot that has seen one frame (diffusers' value)."""

_NO_CPU_POOL = frozenset({torch.bfloat16, torch.float16})
"""Dtypes `avg_pool3d` has no CPU kernel for."""

_NO_FAST_CPU_CONV = frozenset({torch.bfloat16, torch.float16})
"""Dtypes whose CPU convolutions fall back to torch's slow reference kernels on most CPUs.

oneDNN takes a bfloat16 convolution only on CPUs with AVX-512 (or AMX); elsewhere torch runs
``slow_conv3d`` (im2col and a reduced-precision GEMM), about ten times the float32 run's
time for the whole tiny pipeline. float16 has no fast CPU convolution at all.
"""


class _Float32OnCPU:
    """A convolution's ``_conv_forward`` that runs a reduced-precision CPU convolution in
    float32 and rounds the result once (as `_patch_tokens` averages); other devices and
    dtypes run the module's own.

    Installed on every `nn.Conv2d` and `nn.Conv3d` of a reduced-precision model (the Wan VAE's
    causal convolutions included): the same arithmetic on every CPU, whatever its ISA, and
    the same on both session-state paths, which share the networks. A module-level class, so
    the networks still pickle.
    """

    def __init__(self, conv: nn.Module) -> None:
        self.conv = conv

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        forward = type(self.conv)._conv_forward  # type: ignore[attr-defined]
        if x.device.type != "cpu" or x.dtype not in _NO_FAST_CPU_CONV:
            out: torch.Tensor = forward(self.conv, x, weight, bias)
            return out
        wide = None if bias is None else bias.float()
        out = forward(self.conv, x.float(), weight.float(), wide)
        return out.to(x.dtype)


def _patch_tokens(x: torch.Tensor) -> torch.Tensor:
    # (1, C, T, h, w) -> (T * h/2 * w/2, C): 2x2 patches, averaged, one token per patch.
    if x.device.type == "cpu" and x.dtype in _NO_CPU_POOL:
        # CPU has no reduced-precision avg_pool3d kernel: average in float32, round once.
        pooled = torch.nn.functional.avg_pool3d(x.float(), kernel_size=(1, 2, 2)).to(x.dtype)
    else:
        pooled = torch.nn.functional.avg_pool3d(x, kernel_size=(1, 2, 2))
    return pooled.flatten(2)[0].transpose(0, 1).contiguous()


def _patch_tokens_batch(x: torch.Tensor) -> torch.Tensor:
    # (B, C, T, h, w) -> (B, T * h/2 * w/2, C): `_patch_tokens` of each session, batched.
    if x.device.type == "cpu" and x.dtype in _NO_CPU_POOL:
        pooled = torch.nn.functional.avg_pool3d(x.float(), kernel_size=(1, 2, 2)).to(x.dtype)
    else:
        pooled = torch.nn.functional.avg_pool3d(x, kernel_size=(1, 2, 2))
    return pooled.flatten(2).transpose(1, 2).contiguous()


def _chunk_bounds(num_frames: int) -> list[tuple[int, int]]:
    # The Wan streaming split: the first frame alone, then chunks of 4.
    bounds = [(0, 1)]
    bounds += [(s, min(s + 4, num_frames)) for s in range(1, num_frames, 4)]
    return bounds


def build_networks(cfg: DreamZeroConfig, device: torch.device | str = "cpu") -> DreamZeroNetworks:
    """Build every network from its config with seeded random weights (no download).

    On ``device="meta"`` nothing is allocated; shapes and byte counts are still exact.

    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> nets = build_networks(DreamZeroConfig.preset("deploy"), device="meta")
    >>> nets.num_enc_convs
    26
    """
    return DreamZeroNetworks(cfg, device)
