"""The observation transform (crop, resize, stitch), its validation messages, the DreamZero
config (presets, ``from_dict``) and the shipped deploy YAML files."""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

import attrs
import numpy as np
import pytest
import torch
from torch.nn import functional

from sessionstate import ENV_ENABLE, MissingKeyError, OmniDiffusionConfig, tree_leaves, tree_map
from sessionstate.models.dreamzero import (
    CAMERAS,
    FRAMES_PER_CHUNK,
    MAX_DREAMZERO_SESSIONS,
    PRESETS,
    DreamZeroConfig,
    DreamZeroPipeline,
    Observation,
    stitch_views,
)
from sessionstate.models.dreamzero.transform import check_observation
from tests.models.dreamzero.dz_support import random_observation, tiny
from tests.support import ROOT

CONFIGS = ROOT / "configs"
EXT_LEFT, EXT_RIGHT, WRIST = CAMERAS
COLOURS = {EXT_LEFT: (10, 20, 30), EXT_RIGHT: (40, 50, 60), WRIST: (70, 80, 90)}


def _constant(cfg: DreamZeroConfig, colour: tuple[int, int, int]) -> torch.Tensor:
    image = torch.empty((cfg.camera_height, cfg.camera_width, 3), dtype=torch.uint8)
    image[:] = torch.tensor(colour, dtype=torch.uint8)
    return image


def _observation(cfg: DreamZeroConfig, **images: torch.Tensor) -> Observation:
    full = {cam: _constant(cfg, COLOURS[cam]) for cam in CAMERAS}
    full.update(images)
    return Observation(images=full, prompt="pick", state=torch.zeros(cfg.action_dim))


# ---------------------------------------------------------------------------------------------
# Stitching geometry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "deploy"])
def test_canvas_is_wrist_twice_on_top_and_exteriors_below(preset: str) -> None:
    cfg = DreamZeroConfig.preset(preset)
    canvas = stitch_views(_observation(cfg), cfg)
    h, w = cfg.view_height, cfg.view_width
    assert canvas.dtype == torch.uint8
    assert canvas.shape == (2 * h, 2 * w, 3) == (cfg.canvas_height, cfg.canvas_width, 3)
    quadrants = {
        "top-left": (canvas[:h, :w], WRIST),
        "top-right": (canvas[:h, w:], WRIST),
        "bottom-left": (canvas[h:, :w], EXT_LEFT),
        "bottom-right": (canvas[h:, w:], EXT_RIGHT),
    }
    for where, (part, cam) in quadrants.items():
        expected = torch.tensor(COLOURS[cam], dtype=torch.uint8).expand(h, w, 3)
        assert torch.equal(part, expected), where


def test_deploy_geometry_numbers() -> None:
    cfg = DreamZeroConfig.preset("deploy")
    assert (cfg.camera_height, cfg.camera_width) == (180, 320)
    assert (cfg.view_height, cfg.view_width) == (176, 320)
    assert (cfg.canvas_height, cfg.canvas_width) == (352, 640)
    assert (cfg.latent_height, cfg.latent_width) == (44, 80)
    assert cfg.latent_height * cfg.latent_width // 4 == 880  # frame_seqlen upstream


@pytest.mark.parametrize("preset", ["tiny", "deploy"])
def test_centre_crop_at_095_then_resize(preset: str) -> None:
    cfg = DreamZeroConfig.preset(preset)
    hc, wc = cfg.camera_height, cfg.camera_width
    ch, cw = round(hc * 0.95), round(wc * 0.95)
    top, left = (hc - ch) // 2, (wc - cw) // 2
    g = torch.Generator().manual_seed(0)
    base = random_observation(cfg, g)
    reference = stitch_views(base, cfg)

    def with_wrist(image: torch.Tensor) -> Observation:
        return Observation(images={**base.images, WRIST: image}, prompt="p", state=base.state)

    wrist = base.images[WRIST]
    outside = wrist.clone()
    outside[:top], outside[top + ch :] = 255 - outside[:top], 255 - outside[top + ch :]
    outside[:, :left], outside[:, left + cw :] = 0, 255
    assert not torch.equal(outside, wrist)
    assert torch.equal(stitch_views(with_wrist(outside), cfg), reference)
    for rows, cols in [
        (slice(top, top + 1), slice(None)),
        (slice(top + ch - 1, top + ch), slice(None)),
        (slice(None), slice(left, left + 1)),
        (slice(None), slice(left + cw - 1, left + cw)),
    ]:
        inside = wrist.clone()
        inside[rows, cols] = 255 - inside[rows, cols]
        assert not torch.equal(stitch_views(with_wrist(inside), cfg), reference)

    # The transform itself: that crop, a bilinear antialiased resize, rounded to uint8.
    crop = wrist[top : top + ch, left : left + cw].permute(2, 0, 1).unsqueeze(0).float()
    resized = functional.interpolate(
        crop, size=(cfg.view_height, cfg.view_width), mode="bilinear", antialias=True
    )
    view = resized.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0)
    assert torch.equal(reference[: cfg.view_height, : cfg.view_width], view)
    assert torch.equal(reference[: cfg.view_height, cfg.view_width :], view)


# ---------------------------------------------------------------------------------------------
# Bad observations
# ---------------------------------------------------------------------------------------------

_CAMS = "['exterior_image_1_left', 'exterior_image_2_left', 'wrist_image_left']"


def _images(cfg: DreamZeroConfig) -> dict[str, torch.Tensor]:
    return {cam: _constant(cfg, COLOURS[cam]) for cam in CAMERAS}


def test_missing_camera() -> None:
    cfg = tiny()
    images = _images(cfg)
    del images[WRIST]
    msg = (
        f"An observation needs exactly the cameras {_CAMS}; got "
        "['exterior_image_1_left', 'exterior_image_2_left']."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        check_observation(Observation(images, "p", torch.zeros(8)), cfg)


def test_extra_camera() -> None:
    cfg = tiny()
    images = {**_images(cfg), "top_image": _constant(cfg, (1, 2, 3))}
    msg = (
        f"An observation needs exactly the cameras {_CAMS}; got ['exterior_image_1_left', "
        "'exterior_image_2_left', 'top_image', 'wrist_image_left']."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        stitch_views(Observation(images, "p", torch.zeros(8)), cfg)


@pytest.mark.parametrize("shape", [(40, 72, 4), (72, 40, 3), (3, 40, 72), (40, 72)])
def test_wrong_image_shape(shape: tuple[int, ...]) -> None:
    cfg = tiny()
    images = {**_images(cfg), WRIST: torch.zeros(shape, dtype=torch.uint8)}
    msg = (
        f"Camera `wrist_image_left` has shape {shape}, but the `tiny` geometry expects "
        "(40, 72, 3); resize it or use a config with matching camera sizes."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        check_observation(Observation(images, "p", torch.zeros(8)), cfg)


@pytest.mark.parametrize(
    ("image", "shown"),
    [
        (torch.zeros(40, 72, 3), "torch.float32"),
        (torch.zeros(40, 72, 3, dtype=torch.int64), "torch.int64"),
    ],
)
def test_wrong_image_dtype(image: torch.Tensor, shown: str) -> None:
    cfg = tiny()
    images = {**_images(cfg), EXT_LEFT: image}
    msg = (
        f"Camera `exterior_image_1_left` must be a uint8 tensor (H, W, 3), got dtype {shown}; "
        "pass 0..255 pixel values as `torch.uint8`."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        check_observation(Observation(images, "p", torch.zeros(8)), cfg)


@pytest.mark.parametrize(
    ("image", "shown"),
    [([[0] * 3] * 40, "builtins.list"), (np.zeros((40, 72, 3), dtype=np.uint8), "numpy.ndarray")],
)
def test_image_that_is_not_a_tensor(image: object, shown: str) -> None:
    cfg = tiny()
    images = {**_images(cfg), EXT_LEFT: image}
    msg = (
        f"Camera `exterior_image_1_left` must be a uint8 torch.Tensor (H, W, 3), got {shown}; "
        "convert it with `torch.as_tensor(image)`."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        check_observation(Observation(images, "p", torch.zeros(8)), cfg)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "shown"),
    [
        (torch.zeros(7), "torch.Size([7])"),
        (torch.zeros(1, 8), "torch.Size([1, 8])"),
        ([0.0] * 8, "list"),
    ],
)
def test_bad_joint_state(state: object, shown: str) -> None:
    cfg = tiny()
    msg = f"Observation `state` must be a tensor of shape (8,) (7 joints + gripper), got {shown}."
    with pytest.raises(ValueError, match=re.escape(msg)):
        check_observation(Observation(_images(cfg), "p", state), cfg)  # type: ignore[arg-type]


def test_not_an_observation() -> None:
    with pytest.raises(TypeError, match=re.escape("Expected an Observation, got dict.")):
        check_observation({"images": {}}, tiny())  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", ["0", "1"])
def test_pipeline_rejects_bad_observations_on_both_paths(flag: str) -> None:
    cfg = tiny()
    pipe = DreamZeroPipeline(cfg, environ={ENV_ENABLE: flag})
    images = {**_images(cfg), WRIST: torch.zeros(40, 72, 4, dtype=torch.uint8)}
    with pytest.raises(ValueError, match=re.escape("Camera `wrist_image_left` has shape")):
        pipe.forward(Observation(images, "p", torch.zeros(8)), "s")


def test_non_string_prompt_is_rejected() -> None:
    cfg = tiny()
    msg = "Observation `prompt` must be a str, got NoneType."
    with pytest.raises(TypeError, match=re.escape(msg)):
        check_observation(Observation(_images(cfg), None, torch.zeros(8)), cfg)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# DreamZeroConfig
# ---------------------------------------------------------------------------------------------


def test_constants() -> None:
    assert FRAMES_PER_CHUNK == 4
    assert MAX_DREAMZERO_SESSIONS == 64


def test_deploy_preset() -> None:
    cfg = DreamZeroConfig.preset("deploy")
    assert cfg == PRESETS["deploy"]
    assert cfg.name == "deploy"
    assert cfg.dtype == "bfloat16"
    assert cfg.torch_dtype is torch.bfloat16
    assert (cfg.vae_base_dim, cfg.vae_z_dim) == (96, 16)
    assert (cfg.num_frames, cfg.num_latent_frames, cfg.num_frame_per_block) == (33, 9, 2)
    assert cfg.local_attn_size == -1
    assert cfg.crop_scale == 0.95


def test_tiny_preset() -> None:
    cfg = DreamZeroConfig.preset("tiny")
    assert cfg.torch_dtype is torch.float32
    assert (cfg.canvas_height, cfg.canvas_width) == (32, 64)
    assert (cfg.latent_height, cfg.latent_width) == (4, 8)
    assert cfg.num_frame_per_block == 2
    assert cfg.local_attn_size == 9
    assert cfg.vae_z_dim == 16  # same channel structure as deploy


def test_preset_overrides_return_a_new_config() -> None:
    cfg = DreamZeroConfig.preset("tiny", seed=3, view_height=176, view_width=320)
    assert (cfg.seed, cfg.latent_height, cfg.latent_width) == (3, 44, 80)
    assert PRESETS["tiny"].seed == 0
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.seed = 4  # type: ignore[misc]


def test_unknown_preset_message() -> None:
    msg = "Unknown DreamZero preset 'huge'; choose one of ['deploy', 'tiny']."
    with pytest.raises(KeyError, match=re.escape(msg)):
        DreamZeroConfig.preset("huge")
    with pytest.raises(KeyError, match=re.escape(msg)):
        DreamZeroConfig.from_dict({"preset": "huge"})


def test_from_dict() -> None:
    assert DreamZeroConfig.from_dict({}) == PRESETS["deploy"]
    cfg = DreamZeroConfig.from_dict({"preset": "tiny", "local_attn_size": 5, "seed": 2})
    assert cfg == attrs.evolve(PRESETS["tiny"], local_attn_size=5, seed=2)


@pytest.mark.parametrize(("key", "value"), [("bogus", 1), ("name", "mine")])
def test_from_dict_unknown_key_message(key: str, value: object) -> None:
    known = sorted(a.name for a in attrs.fields(DreamZeroConfig) if a.name != "name")
    msg = f"Unknown DreamZero model setting {key!r} (value {value!r}); known: {['preset', *known]}."
    with pytest.raises(KeyError, match=re.escape(msg)):
        DreamZeroConfig.from_dict({"preset": "tiny", key: value})


@pytest.mark.parametrize("value", [0, -2, True, 1.5, "4"])
def test_positive_int_fields_message(value: object) -> None:
    msg = f"`view_height` must be a positive int, got {value!r} ({type(value).__name__})."
    with pytest.raises(ValueError, match=re.escape(msg)):
        DreamZeroConfig.preset("tiny", view_height=value)


def test_unknown_dtype_is_refused() -> None:
    msg = "`dtype` must be one of ['bfloat16', 'float16', 'float32'], got 'float64'."
    with pytest.raises(ValueError, match=re.escape(msg)):
        DreamZeroConfig(dtype="float64")


@pytest.mark.parametrize("scale", [0, 1.5, -0.1, True, "0.9"])
def test_crop_scale_is_validated(scale: object) -> None:
    msg = f"`crop_scale` must be a number in (0, 1], got {scale!r}."
    with pytest.raises(ValueError, match=re.escape(msg)):
        DreamZeroConfig(crop_scale=scale)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Deploy YAML files
# ---------------------------------------------------------------------------------------------


def test_deploy_yaml() -> None:
    deploy = OmniDiffusionConfig.from_yaml(CONFIGS / "dreamzero-deploy.yaml")
    assert deploy.enable_session_state_manager is False
    assert dict(deploy.model) == {"preset": "deploy"}
    assert DreamZeroConfig.from_dict(deploy.model) == PRESETS["deploy"]
    # Built on meta (nothing allocated): the flag is off as shipped, the variable flips it.
    pipe = DreamZeroPipeline(deploy, device="meta", environ={})
    assert pipe.cfg == PRESETS["deploy"]
    assert not pipe.managed
    flipped = DreamZeroPipeline(deploy, device="meta", environ={ENV_ENABLE: "1"})
    assert flipped.managed


def test_tiny_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    deploy = OmniDiffusionConfig.from_yaml(CONFIGS / "dreamzero-tiny.yaml")
    assert deploy.enable_session_state_manager is False
    assert dict(deploy.model) == {"preset": "tiny", "local_attn_size": 9}
    assert DreamZeroConfig.from_dict(deploy.model) == PRESETS["tiny"]
    monkeypatch.delenv(ENV_ENABLE, raising=False)
    assert not DreamZeroPipeline(deploy).managed
    monkeypatch.setenv(ENV_ENABLE, "1")
    assert DreamZeroPipeline(deploy).managed


def test_yaml_with_an_unknown_model_setting(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  preset: tiny\n  view_hieght: 8\n", encoding="utf-8")
    deploy = OmniDiffusionConfig.from_yaml(path)
    with pytest.raises(KeyError, match=re.escape("Unknown DreamZero model setting 'view_hieght'")):
        DreamZeroPipeline(deploy, environ={})


def test_yaml_with_an_unknown_top_level_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("enable_session_state_manger: true\n", encoding="utf-8")
    msg = f"Deploy config {str(path)!r}: Unknown deploy config key 'enable_session_state_manger'"
    with pytest.raises(MissingKeyError, match=re.escape(msg)):
        OmniDiffusionConfig.from_yaml(path)


def test_an_observation_is_a_pytree_whatever_mapping_holds_its_images() -> None:
    img = torch.zeros(4, 6, 3, dtype=torch.uint8)
    obs = Observation(
        images=MappingProxyType({k: img for k in CAMERAS}), prompt="pick", state=torch.zeros(8)
    )
    assert type(obs.images) is dict
    assert len(tree_leaves(obs)) == len(CAMERAS) + 1  # every image and the joint state
    moved = tree_map(lambda t: t + 1, obs)
    assert moved.prompt == "pick"
    assert all(torch.equal(moved.images[k], img + 1) for k in CAMERAS)
