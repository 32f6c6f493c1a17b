"""The models the command line knows: how to build, drive, compare and size each one.

`sessionstate ab` and `sessionstate sizes` are written once against `ModelSpec`; each
reference model registers one, naming its entry points as ``"module:attr"`` strings (`Lazy`):
model packages are imported only when a spec's entry point is called.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from sessionstate import MissingKeyError

__all__ = ["DEFAULT_MODEL", "MODELS", "Lazy", "ModelSpec", "get_model", "lazy_exports"]

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
        tensor_outputs: The names in ``outputs`` compared with `torch.equal`, in order (one
            that is None on both paths, an output this run does not produce, is skipped).
        finals: Per-session results at the end of an episode, by name then session id.
        final_outputs: The names in ``finals``, in the order compared.
        size_table: ``size_table(preset, steps)``: the `sessionstate sizes` JSON.
        size_steps: Default ``--steps`` of `sessionstate sizes`.
        size_footer: Extra table rows and lines printed under the size table, its byte
            counts written by the byte format it is given (the command's).
        buckets: ``buckets()``: every session value's bucket (``attrs``, ``object`` or
            ``engine``), the model's reference table.

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
    size_footer: Callable[[dict[str, Any], Callable[[int], str]], tuple[list[Row], list[str]]]
    buckets: Callable[[], Mapping[str, str]]


@attrs.frozen
class Lazy:
    """A callable named ``"module:attr"``, imported on its first call (vLLM's factory pattern).

    The registry names each model's entry points as strings, so `sessionstate --help` and
    the registry itself import no model (and no torch).

    >>> Lazy("math:sqrt")(16.0)
    4.0
    """

    target: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def load(self) -> Callable[..., Any]:
        """The callable named by `target` (``attr`` may be dotted: ``Class.method``)."""
        module, _, attr = self.target.partition(":")
        found: Any = importlib.import_module(module)
        for part in attr.split("."):
            found = getattr(found, part)
        return found  # type: ignore[no-any-return]


def lazy_exports(
    package: str, where: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package face's PEP 562 ``__getattr__`` and ``__dir__`` over ``where``.

    ``where`` names each submodule of ``package`` and the names it exports; a name is imported
    from its submodule on first use and then kept in the package. So a reader of one small
    part (the plan reads a config's KV geometry) does not import the pipeline and diffusers.

    >>> getattr_, dir_ = lazy_exports("sessionstate.models", {"_registry": ("get_model",)})
    >>> getattr_("get_model") is get_model, "get_model" in dir_()
    (True, True)
    """
    modules = {name: f"{package}.{module}" for module, names in where.items() for name in names}
    namespace = vars(importlib.import_module(package))

    def getattr_(name: str) -> Any:
        if name not in modules:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        value = getattr(importlib.import_module(modules[name]), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(modules))

    return getattr_, dir_


# -- size table footers: formatting of a size table, no model imported ---------------------


def _dz_footer(table: dict[str, Any], fmt: Callable[[int], str]) -> tuple[list[Row], list[str]]:
    feat64 = fmt(table["vae_enc_feat_map_64_sessions_nbytes"])
    rows = [("[bold]64 feature caches", "object", feat64, feat64)]
    return rows, [f"vae_enc_feat_map: {table['vae_enc_feat_map_tensors']} tensors"]


def _c3_footer(table: dict[str, Any], fmt: Callable[[int], str]) -> tuple[list[Row], list[str]]:
    kv64 = table["text_kv_64_sessions_nbytes"]
    kv1 = table["values"]["text_kv"]["bespoke_nbytes"]
    rows = [("[bold]64 text K/V caches", "object", fmt(kv64), f"{fmt(kv1)} (one, shared)")]
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
        config_from_dict=Lazy("sessionstate.models.dreamzero:DreamZeroConfig.from_dict"),
        pipeline=Lazy("sessionstate.models.dreamzero:DreamZeroPipeline"),
        episode=Lazy("sessionstate.models.dreamzero.episode:scripted_episode"),
        outputs=Lazy("sessionstate.models.dreamzero.episode:outputs"),
        tensor_outputs=("actions", "video", "frames"),
        finals=Lazy("sessionstate.models.dreamzero.episode:finals"),
        final_outputs=("latents", "decoded"),
        size_table=Lazy("sessionstate.models.dreamzero.sizes:size_table"),
        size_steps=400,
        size_footer=_dz_footer,
        buckets=Lazy("sessionstate.models.dreamzero.state:BUCKETS.copy"),
    ),
    "cosmos3": ModelSpec(
        name="cosmos3",
        title="Cosmos3",
        config_from_dict=Lazy("sessionstate.models.cosmos3:Cosmos3Config.from_dict"),
        pipeline=Lazy("sessionstate.models.cosmos3:Cosmos3Pipeline"),
        episode=Lazy("sessionstate.models.cosmos3.episode:scripted_episode"),
        outputs=Lazy("sessionstate.models.cosmos3.episode:outputs"),
        tensor_outputs=("video",),
        finals=Lazy("sessionstate.models.cosmos3.episode:finals"),
        final_outputs=("latents",),
        size_table=Lazy("sessionstate.models.cosmos3.sizes:size_table"),
        size_steps=8,
        size_footer=_c3_footer,
        buckets=Lazy("sessionstate.models.cosmos3.state:BUCKETS.copy"),
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
