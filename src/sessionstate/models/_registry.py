"""The models the command line knows: how to build, drive, compare and size each one.

`sessionstate ab` and `sessionstate sizes` are written once against `ModelSpec`; each
reference model registers one. Model packages are imported only when a spec is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from sessionstate import MissingKeyError

__all__ = ["DEFAULT_MODEL", "MODELS", "ModelSpec", "get_model"]

Row = tuple[str, str, str, str]


@attrs.frozen(kw_only=True)
class ModelSpec:
    """What the command line needs from a reference model.

    Args:
        name: The ``--model`` value.
        title: The model's name in headings.
        config_from_dict: Builds the model config from a deploy config's ``model`` section.
        pipeline: Builds the pipeline: ``pipeline(deploy_config, max_bespoke_sessions=n)``.
        episode: The scripted episode: ``episode(cfg, steps=, sessions=, seed=)`` yielding
            ``(session_id, input)``.
        outputs: One step's comparable outputs by name: tensors first, then ``reset``.
        tensor_outputs: The names in ``outputs`` compared with `torch.equal`, in order.
        finals: Per-session results at the end of an episode, by name then session id.
        final_outputs: The names in ``finals``, in the order compared.
        size_table: ``size_table(preset, steps)``: the `sessionstate sizes` JSON.
        size_steps: Default ``--steps`` of `sessionstate sizes`.
        size_footer: Extra table rows and lines printed under the size table.

    >>> spec = get_model("cosmos3")
    >>> spec.title, spec.tensor_outputs
    ('Cosmos3', ('video',))
    """

    name: str
    title: str
    config_from_dict: Callable[[Mapping[str, Any]], Any]
    pipeline: Callable[..., Any]
    episode: Callable[..., Iterator[tuple[str, Any]]]
    outputs: Callable[[Any], dict[str, Any]]
    tensor_outputs: tuple[str, ...]
    finals: Callable[[Any], dict[str, dict[str, Any]]]
    final_outputs: tuple[str, ...]
    size_table: Callable[[str, int], dict[str, Any]]
    size_steps: int
    size_footer: Callable[[dict[str, Any]], tuple[list[Row], list[str]]]


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


# -- DreamZero -------------------------------------------------------------------------------


def _dz_config(model: Mapping[str, Any]) -> Any:
    from sessionstate.models.dreamzero import DreamZeroConfig

    return DreamZeroConfig.from_dict(model)


def _dz_pipeline(deploy: Any, **kwargs: Any) -> Any:
    from sessionstate.models.dreamzero import DreamZeroPipeline

    return DreamZeroPipeline(deploy, **kwargs)


def _dz_episode(cfg: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
    from sessionstate.models.dreamzero.episode import scripted_episode

    return scripted_episode(cfg, **kwargs)


def _dz_outputs(out: Any) -> dict[str, Any]:
    return {"actions": out.actions, "video": out.video_latents, "reset": out.reset}


def _dz_finals(pipe: Any) -> dict[str, dict[str, Any]]:
    decoded = {sid: pipe.decode_video(sid) for sid in pipe.session_ids()}
    latents = {sid: pipe.video_latents(sid) for sid in pipe.session_ids()}
    return {"decoded": decoded, "latents": latents}


def _dz_sizes(preset: str, steps: int) -> dict[str, Any]:
    from sessionstate.models.dreamzero.sizes import size_table

    return size_table(preset, steps)


def _dz_footer(table: dict[str, Any]) -> tuple[list[Row], list[str]]:
    feat64 = _gib(table["vae_enc_feat_map_64_sessions_nbytes"])
    rows = [("[bold]64 feature caches", "object", feat64, feat64)]
    return rows, [f"vae_enc_feat_map: {table['vae_enc_feat_map_tensors']} tensors"]


# -- Cosmos3 -----------------------------------------------------------------------------------


def _c3_config(model: Mapping[str, Any]) -> Any:
    from sessionstate.models.cosmos3 import Cosmos3Config

    return Cosmos3Config.from_dict(model)


def _c3_pipeline(deploy: Any, **kwargs: Any) -> Any:
    from sessionstate.models.cosmos3 import Cosmos3Pipeline

    return Cosmos3Pipeline(deploy, **kwargs)


def _c3_episode(cfg: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
    from sessionstate.models.cosmos3.episode import scripted_episode

    return scripted_episode(cfg, **kwargs)


def _c3_outputs(out: Any) -> dict[str, Any]:
    return {"video": out.video_latents, "reset": out.reset}


def _c3_finals(pipe: Any) -> dict[str, dict[str, Any]]:
    return {"latents": {sid: pipe.video_latents(sid) for sid in pipe.session_ids()}}


def _c3_sizes(preset: str, steps: int) -> dict[str, Any]:
    from sessionstate.models.cosmos3.sizes import size_table

    return size_table(preset, steps)


def _c3_footer(table: dict[str, Any]) -> tuple[list[Row], list[str]]:
    kv64 = table["text_kv_64_sessions_nbytes"]
    kv1 = table["values"]["text_kv"]["bespoke_nbytes"]
    rows = [("[bold]64 text K/V caches", "object", _gib(kv64), f"{_gib(kv1)} (one, shared)")]
    geo = table["text_kv_geometry"]
    line = (
        f"text_kv: {table['text_kv_layers']} layers x {table['text_kv_branches']} branches, "
        f"K and V each (1, {geo['num_kv_heads']}, {geo['text_len']}, {geo['head_dim']}) "
        f"{geo['dtype']}; bespoke keeps {', '.join(table['bespoke_per_instance'])} once per "
        "transformer instance"
    )
    return rows, [line]


DEFAULT_MODEL = "dreamzero"
"""The model `sessionstate ab` and `sessionstate sizes` use without ``--model``."""

MODELS: dict[str, ModelSpec] = {
    "dreamzero": ModelSpec(
        name="dreamzero",
        title="DreamZero",
        config_from_dict=_dz_config,
        pipeline=_dz_pipeline,
        episode=_dz_episode,
        outputs=_dz_outputs,
        tensor_outputs=("actions", "video"),
        finals=_dz_finals,
        final_outputs=("latents", "decoded"),
        size_table=_dz_sizes,
        size_steps=400,
        size_footer=_dz_footer,
    ),
    "cosmos3": ModelSpec(
        name="cosmos3",
        title="Cosmos3",
        config_from_dict=_c3_config,
        pipeline=_c3_pipeline,
        episode=_c3_episode,
        outputs=_c3_outputs,
        tensor_outputs=("video",),
        finals=_c3_finals,
        final_outputs=("latents",),
        size_table=_c3_sizes,
        size_steps=8,
        size_footer=_c3_footer,
    ),
}
"""Every model the command line knows, by ``--model`` name."""


def get_model(name: str) -> ModelSpec:
    """The spec of model ``name``.

    Raises:
        KeyError: for an unknown name, listing the known ones.

    >>> get_model("dreamzero").size_steps
    400
    """
    if name not in MODELS:
        msg = f"Unknown model {name!r}; choose one of {sorted(MODELS)}."
        raise MissingKeyError(msg)
    return MODELS[name]
