"""Both reference models' configs from a preset name and a deploy config's ``model`` section.

One place for the rules both configs follow: a preset is a named config, overridden field by
field; a ``model`` section is ``preset`` (default ``deploy``) plus overrides, and an unknown
key is refused with the closest known one ("did you mean") and the list of known keys.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from sessionstate import MissingKeyError

__all__ = ["from_preset", "from_section"]

C = TypeVar("C")


def from_preset(model: str, presets: Mapping[str, C], name: str, /, **overrides: Any) -> C:
    """The preset ``name`` of ``presets``, with fields overridden.

    Raises:
        KeyError: for an unknown preset name, naming the known ones.

    >>> @attrs.frozen
    ... class Toy:
    ...     width: int = 1
    >>> from_preset("Toy", {"tiny": Toy()}, "tiny", width=3)
    Toy(width=3)
    """
    if name not in presets:
        msg = f"Unknown {model} preset {name!r}; choose one of {sorted(presets)}."
        raise MissingKeyError(msg)
    return attrs.evolve(presets[name], **overrides)  # type: ignore[misc]


def from_section(
    model: str, presets: Mapping[str, C], cls: type[C], data: Mapping[str, Any], /
) -> C:
    """A config of ``cls`` from a ``model`` section: ``preset`` plus field overrides.

    Raises:
        KeyError: for an unknown key or preset, naming it, the closest known key and the
            known ones.

    >>> @attrs.frozen
    ... class Toy:
    ...     name: str = "tiny"
    ...     width: int = 1
    >>> from_section("Toy", {"deploy": Toy()}, Toy, {"width": 2})
    Toy(name='tiny', width=2)
    >>> try:
    ...     from_section("Toy", {"deploy": Toy()}, Toy, {"widht": 2})
    ... except KeyError as exc:
    ...     print(exc.args[0])
    Unknown Toy model setting 'widht' (value 2); did you mean 'width'? Known: ['preset', 'width'].
    """
    data = dict(data)
    preset = data.pop("preset", "deploy")
    known = {a.name for a in attrs.fields(cls)} - {"name"}  # type: ignore[arg-type]
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), ["preset", *known], n=1)
            hint = f"did you mean {close[0]!r}? Known" if close else "known"
            msg = (
                f"Unknown {model} model setting {key!r} (value {data[key]!r}); {hint}: "
                f"{['preset', *sorted(known)]}."
            )
            raise MissingKeyError(msg)
    return from_preset(model, presets, preset, **data)
