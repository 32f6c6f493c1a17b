"""The model code both Cosmos3 session paths run: networks, prompts, the denoising loop.

Nothing here holds session state: a path passes in what its session holds (the context, the
RoPE tables, a source of each guidance branch's K/V) and keeps what comes back. Where the
encode-once K/V lives is the one thing the paths do differently, so the denoising loop reads
it through ``kv_for(branch)`` and the path encodes on the first read with `encode_branch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from sessionstate import KVPair, RandomKey, record, static_field
from sessionstate.models._kit import SessionMessages, live_key
from sessionstate.models.cosmos3.config import Cosmos3Config
from sessionstate.models.cosmos3.networks import Cosmos3Networks, build_networks

__all__ = [
    "Cosmos3Model",
    "Cosmos3Output",
    "Cosmos3Request",
    "KVSource",
    "lost_continuation",
    "prompt_changed",
    "unknown_session",
]

KVSource = Callable[[str], Sequence[KVPair]]
"""``kv_for(branch)``: every layer's K/V pair of one guidance branch, in layer order."""


@record
class Cosmos3Request:
    """One streaming step's input: the prompts and a control vector (e.g. a camera action).

    A record: a pytree of its control tensor, the prompts static data.
    """

    prompt: str = static_field()
    control: torch.Tensor
    negative_prompt: str = static_field(default="")


@record
class Cosmos3Output:
    """What one forward returns: the chunk's latents, and ``"session"`` if it reset.

    A record: a pytree of its latents, with the reset reason as static data, so `tree_equal`,
    `tree_map` and `save_state` take it whole.
    """

    video_latents: torch.Tensor
    reset: str | None = static_field()


_MESSAGES = SessionMessages("Cosmos3", "request")
unknown_session = _MESSAGES.unknown
"""The message for a lookup of a session that is not held."""
lost_continuation = _MESSAGES.lost
"""The message for ``forward(..., begin=False)`` of a session that is not held."""


def prompt_changed(
    held: torch.Tensor | None,
    held_negative: torch.Tensor | None,
    tokens: torch.Tensor,
    neg: torch.Tensor,
) -> bool:
    """The reset rule: a session resets when it has no prompt yet or either prompt changed.

    >>> t = torch.tensor([[1, 2]])
    >>> prompt_changed(None, None, t, t), prompt_changed(t, t, t, t)
    (True, False)
    """
    if held is None or held_negative is None:
        return True
    return not (torch.equal(held, tokens) and torch.equal(held_negative, neg))


class Cosmos3Model:
    """The networks and geometry both paths share, and the stateless denoising loop.

    Args:
        cfg: The model's geometry.
        device: Where the networks and per-step tensors live.
        host_device: Where accumulated video latents are kept.

    >>> from sessionstate.models.cosmos3 import Cosmos3Config
    >>> model = Cosmos3Model(Cosmos3Config.preset("tiny"), "cpu", "cpu")
    >>> model.cfg.num_layers, model.encodes
    (3, 0)
    """

    def __init__(
        self, cfg: Cosmos3Config, device: torch.device | str, host_device: torch.device | str
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.host_device = torch.device(host_device)
        self.nets: Cosmos3Networks = build_networks(cfg, self.device)
        self.encodes = 0
        """Prompt encodings run so far (one per branch encoded)."""

    def texts(self, request: Cosmos3Request) -> dict[str, torch.Tensor]:
        """The token ids of each guidance branch: the prompt and the negative prompt."""
        return {
            "cond": self.nets.tokenize(request.prompt),
            "uncond": self.nets.tokenize(request.negative_prompt),
        }

    def encode_branch(self, tokens: torch.Tensor) -> Iterator[KVPair]:
        """Encode one branch's tokens, layer by layer, counting the encoding in `encodes`."""
        self.encodes += 1
        return self.nets.encode_layers(tokens)

    def noise(self, key: RandomKey) -> tuple[torch.Tensor, RandomKey]:
        """A chunk's starting noise drawn from the session's key, and the next key.

        A key not allocated (a record saved before sessions held one) is seeded from the
        config's ``seed`` first.

        >>> from sessionstate.models.cosmos3 import Cosmos3Config
        >>> model = Cosmos3Model(Cosmos3Config.preset("tiny"), "cpu", "cpu")
        >>> model.noise(RandomKey())[1].counter
        1
        """
        return self.nets.noise(live_key(key, self.cfg.seed))

    def denoise(
        self,
        noise: torch.Tensor,
        context: torch.Tensor,
        control: torch.Tensor,
        rope: torch.Tensor,
        kv_for: KVSource,
    ) -> torch.Tensor:
        """Denoise one chunk from ``noise`` (see `noise`) with guidance; ``kv_for(branch)``
        supplies each branch's K/V."""
        nets = self.nets
        latents = noise
        control = control.to(device=self.device, dtype=nets.dtype)
        for sigma, sigma_next in zip(nets.sigmas[:-1], nets.sigmas[1:], strict=True):
            cond, uncond = kv_for("cond"), kv_for("uncond")
            v = nets.guided_velocity(latents, sigma, context, control, rope, cond, uncond)
            latents = latents + (sigma_next - sigma) * v
        return latents

    def denoise_batch(
        self,
        noises: Sequence[torch.Tensor],
        contexts: Sequence[torch.Tensor],
        controls: Sequence[torch.Tensor],
        rope: torch.Tensor,
        kv_fors: Sequence[KVSource],
        *,
        batch_invariant: bool = False,
    ) -> list[torch.Tensor]:
        """`denoise` of a batch of sessions whose contexts have one shape, in one loop.

        Each session's noise (drawn from its key, `noise`), context, control and K/V are its
        own (K/V read once, before the loop, each branch encoded where missing); the Euler
        updates run on the whole batch. Returns each session's latents, its own tensor
        (1, C, T, H, W).

        With ``batch_invariant``, the transformer runs once per session inside the batched
        loop (its matrix products and softmax may round differently when a kernel is given
        more rows): each session's latents then equal its own `denoise`, bit for bit. Without
        it the transformer runs once on the whole batch, and the latents agree with the
        per-session ones to within rounding.
        """
        nets = self.nets
        size = len(noises)
        latents = torch.cat(list(noises))
        context = torch.cat(list(contexts))
        control = torch.stack([c.to(device=self.device, dtype=nets.dtype) for c in controls])
        kv = [(kv_for("cond"), kv_for("uncond")) for kv_for in kv_fors]
        if not batch_invariant:
            cond, uncond = (_stacked([pairs[b] for pairs in kv]) for b in (0, 1))
        for sigma, sigma_next in zip(nets.sigmas[:-1], nets.sigmas[1:], strict=True):
            if batch_invariant:
                v = torch.cat(
                    [
                        nets.guided_velocity(
                            latents[i : i + 1], sigma, context[i : i + 1], control[i], rope, *kv[i]
                        )
                        for i in range(size)
                    ]
                )
            else:
                v = nets.guided_velocity(latents, sigma, context, control, rope, cond, uncond)
            latents = latents + (sigma_next - sigma) * v
        return [latents[i : i + 1].clone() for i in range(size)]


def _stacked(sessions: Sequence[Sequence[KVPair]]) -> list[KVPair]:
    # Every layer's K/V of a batch of sessions: each session's pair joined along the batch.
    return [
        KVPair(torch.cat([p.key for p in layer]), torch.cat([p.value for p in layer]))
        for layer in zip(*sessions, strict=True)
    ]
