"""Observation transform: three camera views, cropped, resized and stitched into one canvas."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn import functional

from sessionstate import field, record, static_field
from sessionstate.models.dreamzero.config import DreamZeroConfig

__all__ = ["CAMERAS", "Observation", "check_observation", "stitch_views"]

CAMERAS = ("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left")
"""Camera keys, DROID naming: left exterior, right exterior, wrist."""


def _as_dict(images: object) -> object:
    # Any mapping of images is held as a dict, a pytree node (a `MappingProxyType` is a
    # leaf); anything else is kept for `check_observation` to name.
    return dict(images) if isinstance(images, Mapping) else images


@record
class Observation:
    """One robot observation: three uint8 camera images (H, W, 3), a prompt and joint state.

    A record: a pytree of its images and state, the prompt static data.

    >>> import torch
    >>> img = torch.zeros(40, 72, 3, dtype=torch.uint8)
    >>> obs = Observation(images={k: img for k in CAMERAS}, prompt="pick", state=torch.zeros(8))
    >>> obs.prompt
    'pick'
    """

    images: Mapping[str, torch.Tensor] = field(converter=_as_dict)
    prompt: str = static_field()
    state: torch.Tensor


def _prepare_view(image: torch.Tensor, cfg: DreamZeroConfig) -> torch.Tensor:
    h, w = image.shape[0], image.shape[1]
    ch, cw = round(h * cfg.crop_scale), round(w * cfg.crop_scale)
    top, left = (h - ch) // 2, (w - cw) // 2
    crop = image[top : top + ch, left : left + cw]
    x = crop.permute(2, 0, 1).unsqueeze(0).float()
    x = functional.interpolate(
        x, size=(cfg.view_height, cfg.view_width), mode="bilinear", antialias=True
    )
    return x.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0)


def check_observation(obs: Observation, cfg: DreamZeroConfig) -> None:
    """Raise a clear error if ``obs`` does not match the configured cameras.

    Raises:
        TypeError: if ``obs`` is not an Observation, or an image is not a uint8 tensor.
        ValueError: for missing or extra cameras, or an image of the wrong shape.

    >>> import torch
    >>> cfg = DreamZeroConfig.preset("tiny")
    >>> img = torch.zeros(40, 72, 3, dtype=torch.uint8)
    >>> check_observation(Observation({k: img for k in CAMERAS}, "p", torch.zeros(8)), cfg)
    """
    if not isinstance(obs, Observation):
        msg = f"Expected an Observation, got {type(obs).__name__}."
        raise TypeError(msg)
    if not isinstance(obs.prompt, str):
        msg = f"Observation `prompt` must be a str, got {type(obs.prompt).__name__}."
        raise TypeError(msg)
    if not isinstance(obs.images, Mapping):
        msg = (
            f"Observation `images` must be a mapping of camera name to image, got "
            f"{type(obs.images).__name__}; pass a dict with the keys {list(CAMERAS)}."
        )
        raise TypeError(msg)
    if set(obs.images) != set(CAMERAS):
        msg = f"An observation needs exactly the cameras {list(CAMERAS)}; got {sorted(obs.images)}."
        raise ValueError(msg)
    expected = (cfg.camera_height, cfg.camera_width, 3)
    for key in CAMERAS:
        image = obs.images[key]
        if not isinstance(image, torch.Tensor):
            msg = (
                f"Camera `{key}` must be a uint8 torch.Tensor (H, W, 3), got "
                f"{type(image).__module__}.{type(image).__qualname__}; convert it with "
                "`torch.as_tensor(image)`."
            )
            raise TypeError(msg)
        if image.dtype != torch.uint8:
            msg = (
                f"Camera `{key}` must be a uint8 tensor (H, W, 3), got dtype {image.dtype}; "
                "pass 0..255 pixel values as `torch.uint8`."
            )
            raise TypeError(msg)
        if tuple(image.shape) != expected:
            msg = (
                f"Camera `{key}` has shape {tuple(image.shape)}, but the `{cfg.name}` geometry "
                f"expects {expected}; resize it or use a config with matching camera sizes."
            )
            raise ValueError(msg)
    if not isinstance(obs.state, torch.Tensor) or tuple(obs.state.shape) != (cfg.action_dim,):
        msg = (
            f"Observation `state` must be a tensor of shape ({cfg.action_dim},) (7 joints + "
            f"gripper), got {getattr(obs.state, 'shape', type(obs.state).__name__)}."
        )
        raise ValueError(msg)


def stitch_views(obs: Observation, cfg: DreamZeroConfig) -> torch.Tensor:
    """The stitched uint8 canvas (2H, 2W, 3): wrist view twice on top, exteriors below.

    >>> import torch
    >>> cfg = DreamZeroConfig.preset("tiny")
    >>> img = torch.zeros(40, 72, 3, dtype=torch.uint8)
    >>> stitch_views(Observation({k: img for k in CAMERAS}, "p", torch.zeros(8)), cfg).shape
    torch.Size([32, 64, 3])
    """
    check_observation(obs, cfg)
    left = _prepare_view(obs.images["exterior_image_1_left"], cfg)
    right = _prepare_view(obs.images["exterior_image_2_left"], cfg)
    wrist = _prepare_view(obs.images["wrist_image_left"], cfg)
    top = torch.cat([wrist, wrist], dim=1)
    bottom = torch.cat([left, right], dim=1)
    return torch.cat([top, bottom], dim=0)
