"""Deploy configuration and the environment overrides that flip the manager per process."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeVar

import attrs
import yaml

from sessionstate._checks import HOST_POOL_FULL_CHOICES, ON_FULL_CHOICES, a_bool, check_choice
from sessionstate._env import (
    ENV_CHECK_IMMUTABLE,
    ENV_ENABLE,
    ENV_HOST_POOL_BYTES,
    ENV_KV_POOL_BYTES,
    ENV_MAX_BYTES,
    ENV_MAX_SESSIONS,
    ENV_ON_FULL,
)
from sessionstate._errors import MissingKeyError
from sessionstate._manager import (
    DEFAULT_MAX_SESSIONS,
    BudgetTextError,
    OnFull,
    is_budget_device,
    parse_budget_text,
    parse_nbytes,
    zero_budget,
)
from sessionstate._storage import Tier, check_tier

__all__ = [
    "ENV_CHECK_IMMUTABLE",
    "ENV_ENABLE",
    "ENV_HOST_POOL_BYTES",
    "ENV_KV_POOL_BYTES",
    "ENV_MAX_BYTES",
    "ENV_MAX_SESSIONS",
    "ENV_ON_FULL",
    "OmniDiffusionConfig",
    "SessionStateSettings",
    "parse_env_flag",
    "resolve_session_state_config",
]

_ON_FULL: tuple[OnFull, ...] = ("evict", "refuse")

HostPoolFull = Literal["disk", "refuse"]

_DEVICE_RULE = (
    "name each budgeted device as tensors report it: a CUDA device with its index "
    "('cuda:0'), or 'cpu'"
)

MaxBytes = int | Mapping[str, int]
"""A byte budget: one count (for the model's device) or a count per device string."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

logger = logging.getLogger("sessionstate")

_T = TypeVar("_T")


class _DuplicateKeyError(Exception):
    pass


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (YAML says keys are
    unique; PyYAML would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, Hashable) and key in lines:
                msg = (
                    f"key {key!r} appears twice in one mapping (lines {lines[key]} and {line}); "
                    "keep one."
                )
                raise _DuplicateKeyError(msg)
            if isinstance(key, Hashable):
                lines[key] = line
        return super().construct_mapping(node, deep=deep)


def _check_mapping(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Mapping):
        msg = (
            f"`{attribute.name}` must be a mapping of model settings, got {value!r} "
            f"({type(value).__name__})."
        )
        raise TypeError(msg)


def _to_max_bytes(value: Any) -> MaxBytes | None:
    if value is None:
        return None
    if isinstance(value, str) and "=" in value:  # the environment's per-device form
        parsed = _budget_or_problem(value)
        if isinstance(parsed, str):
            msg = f"`session_state_max_bytes` {value!r} is not a budget: {parsed}."
            raise ValueError(msg)
        return MappingProxyType(dict(parsed)) if isinstance(parsed, Mapping) else parsed
    if not isinstance(value, Mapping):
        return _positive_budget(value, "session_state_max_bytes")
    out: dict[str, int] = {}
    for device, n in value.items():
        if not isinstance(device, str) or not is_budget_device(device):
            msg = (
                f"`session_state_max_bytes` key {device!r} ({type(device).__name__}) is not a "
                f"device name tensors report; {_DEVICE_RULE}."
            )
            raise ValueError(msg)
        out[device] = _positive_budget(n, f"session_state_max_bytes[{device!r}]")
    return MappingProxyType(out)


def _positive_budget(value: object, name: str) -> int:
    n = parse_nbytes(value, name=name)
    if n == 0:
        msg = f"`{name}` must be at least 1 byte: {zero_budget(value)}."
        raise ValueError(msg)
    return n


def _to_kv_pool_bytes(value: Any) -> int | None:
    return None if value is None else _positive_budget(value, "session_state_kv_pool_bytes")


def _to_host_pool_bytes(value: Any) -> int | None:
    return None if value is None else _positive_budget(value, "session_state_host_pool_bytes")


def _check_host_pool_full(instance: Any, attribute: Any, value: Any) -> None:
    check_choice(value, attribute.name, HOST_POOL_FULL_CHOICES)


def _to_tier(value: Any) -> Tier:
    try:
        return check_tier(value)
    except ValueError:
        msg = (
            f"`session_state_park_tier` must be 'host' or 'disk', got {value!r} "
            f"({type(value).__name__})."
        )
        raise ValueError(msg) from None


def parse_max_bytes(text: str, /) -> MaxBytes | None:
    """Parse a budget written as text; None when it is not one.

    One byte count (``"24GiB"``) applies to the model's device; ``device=count`` pairs
    separated by commas (``"cuda:0=24GiB,cpu=8GiB"``) name devices, each once, as tensors
    report them. A budget of 0 bytes (``"0"``, ``"0.5"``) is not one: it would refuse every
    session.

    >>> parse_max_bytes("24GiB"), parse_max_bytes("cuda:0=1KiB, cpu=2"), parse_max_bytes("lots")
    (25769803776, {'cuda:0': 1024, 'cpu': 2}, None)
    >>> parse_max_bytes("foo=1GiB"), parse_max_bytes("0.5"), parse_max_bytes("cpu=1,cpu=2")
    (None, None, None)
    """
    parsed = _budget_or_problem(text)
    return None if isinstance(parsed, str) else parsed


_UNPARSABLE = (
    "expected a byte count such as 24GiB, or device=count pairs such as cuda:0=24GiB,cpu=8GiB"
)


def _budget_or_problem(text: str) -> MaxBytes | str:
    """The budget ``text`` writes (`parse_budget_text`), or why it is not one (for the warning)."""
    try:
        return parse_budget_text(text, positive=True)
    except BudgetTextError as error:
        if error.rule == "device" and error.part:
            return f"{error.part!r} is not a device name tensors report; {_DEVICE_RULE}"
        if error.rule == "twice":
            return f"device {error.part!r} is named twice; name each device once"
        if error.rule == "zero":
            return str(error)
        return _UNPARSABLE


def _check_on_full(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_choice(value, attribute.name, ON_FULL_CHOICES)


def _read_only(value: Any) -> Any:
    # A frozen config whose `model` section could be mutated in place would not be frozen.
    return MappingProxyType(dict(value)) if isinstance(value, Mapping) else value


@attrs.frozen
class OmniDiffusionConfig:
    """A deploy configuration.

    Args:
        enable_session_state_manager: Use the manager-backed session state path. Off by
            default; with it off, models run their bespoke state paths unchanged. The
            environment variable ``OMNI_DIFFUSION_SESSION_STATE_MANAGER`` overrides it.
        model: The model's own settings (for DreamZero: ``preset`` and geometry overrides),
            validated by the model.
        session_state_on_full: What a new session does when the session table (the
            manager's, or a model's bespoke one) is at its cap: ``"evict"`` (default) drops
            the least recently used session, ``"refuse"`` refuses the new one. The
            environment variable ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL`` overrides it.
        session_state_max_bytes: The manager's byte budget: one count for the model's device,
            or a mapping from device string to count; ints or strings such as ``"24GiB"``.
            None (default) enforces no budget. The environment variable
            ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES`` overrides it.
        session_state_park_tier: Where the budget parks state objects: ``"host"`` (default)
            or ``"disk"``.
        session_state_spool_dir: The directory the disk tier writes under (a temporary one
            when None).
        session_state_kv_pool_bytes: The bytes of an engine-owned KV pool (an int or a string
            such as ``"40GiB"``): the pool holds as many whole blocks as fit. None (default)
            leaves the size to the model. The environment variable
            ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_KV_POOL_BYTES`` overrides it.
        session_state_host_pool_bytes: The bytes of the host tier's buffer pool (an int or a
            string such as ``"64GiB"``): one preallocated, pre-touched (pinned for CUDA)
            buffer that parks copy into, instead of an allocation per park. None (default)
            allocates per park. The environment variable
            ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_HOST_POOL_BYTES`` overrides it.
        session_state_host_pool_full: What a park the host pool cannot hold does: ``"disk"``
            (default) spills it to the disk tier, ``"refuse"`` refuses it (the session stays
            resident, and the budget evicts or refuses as ``session_state_on_full`` says).
        session_state_keep_parked_copies: Whether an unpark keeps the tier's copy of the
            objects it restored while the session holds them unchanged, so that parking it
            again copies only what changed (default True; see the manager's
            ``keep_parked_copies``).

    >>> OmniDiffusionConfig(enable_session_state_manager=True).enable_session_state_manager
    True
    """

    enable_session_state_manager: bool = attrs.field(default=False, validator=a_bool)
    model: Mapping[str, Any] = attrs.field(
        factory=dict, validator=_check_mapping, converter=_read_only
    )
    session_state_on_full: OnFull = attrs.field(default="evict", validator=_check_on_full)
    session_state_max_bytes: MaxBytes | None = attrs.field(
        default=None, converter=_to_max_bytes, kw_only=True
    )
    session_state_park_tier: Tier = attrs.field(default="host", converter=_to_tier, kw_only=True)
    session_state_spool_dir: str | None = attrs.field(default=None, kw_only=True)
    session_state_kv_pool_bytes: int | None = attrs.field(
        default=None, converter=_to_kv_pool_bytes, kw_only=True
    )
    session_state_host_pool_bytes: int | None = attrs.field(
        default=None, converter=_to_host_pool_bytes, kw_only=True
    )
    session_state_host_pool_full: HostPoolFull = attrs.field(
        default="disk", validator=_check_host_pool_full, kw_only=True
    )
    session_state_keep_parked_copies: bool = attrs.field(
        default=True, validator=a_bool, kw_only=True
    )
    source: str | None = attrs.field(default=None, kw_only=True, repr=False, eq=False)
    """The file this config was loaded from (set by `from_yaml`), named in its errors."""

    def parse_model(self, parse: Callable[[Mapping[str, Any]], _T], /) -> _T:
        """Return ``parse(self.model)``; an error it raises names the file the config came from.

        Models validate their own ``model`` section; this keeps the file name in their errors.

        Raises:
            KeyError, TypeError, ValueError: as ``parse``, prefixed with
                ``Deploy config '<path>', `model` section:`` for a config loaded from a file.

        >>> OmniDiffusionConfig(model={"width": 8}).parse_model(lambda m: m["width"] * 2)
        16
        """
        try:
            return parse(self.model)
        except (KeyError, TypeError, ValueError) as exc:
            if self.source is None:
                raise
            msg = f"Deploy config {self.source!r}, `model` section: {exc}"
            kind = (
                MissingKeyError
                if isinstance(exc, KeyError)
                else TypeError
                if isinstance(exc, TypeError)
                else ValueError
            )
            raise kind(msg) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], /) -> OmniDiffusionConfig:
        """Build a config from a mapping (a parsed deploy YAML); unknown keys are errors.

        Raises:
            KeyError: for an unknown key, naming it and the known ones.
            TypeError: for a value of the wrong type, naming the key and the value.

        >>> OmniDiffusionConfig.from_dict({"enable_session_state_manager": True})
        ... # doctest: +NORMALIZE_WHITESPACE
        OmniDiffusionConfig(enable_session_state_manager=True, model=mappingproxy({}),
            session_state_on_full='evict', session_state_max_bytes=None,
            session_state_park_tier='host', session_state_spool_dir=None,
            session_state_kv_pool_bytes=None, session_state_host_pool_bytes=None,
            session_state_host_pool_full='disk', session_state_keep_parked_copies=True)
        """
        if not isinstance(data, Mapping):
            msg = f"A deploy config must be a mapping of keys to values, got {type(data).__name__}."
            raise TypeError(msg)
        known = {a.name for a in attrs.fields(cls)} - {"source"}
        for key in data:
            if key not in known:
                msg = (
                    f"Unknown deploy config key {key!r} (value {data[key]!r}); known keys: "
                    f"{sorted(known)}."
                )
                raise MissingKeyError(msg)
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], /) -> OmniDiffusionConfig:
        """Load a deploy YAML file.

        The loader is strict: a key given twice in one mapping is an error (naming the key and
        both lines), as is a file that is not UTF-8 text. Every error names the file.

        Raises:
            FileNotFoundError: if there is no such file.
            ValueError: if the file is not UTF-8 or not valid YAML (the parser's message
                included), or repeats a key.
            KeyError, TypeError, ValueError: as `from_dict`.

        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "deploy.yaml"
        >>> _ = p.write_text("enable_session_state_manager: true\\n")
        >>> OmniDiffusionConfig.from_yaml(p).enable_session_state_manager
        True
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            msg = (
                f"Deploy config {str(path)!r}: the file is not UTF-8 text ({exc}); "
                "save it as UTF-8."
            )
            raise ValueError(msg) from None
        try:
            data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
        except yaml.YAMLError as exc:
            msg = f"Deploy config {str(path)!r} is not valid YAML: {exc}"
            raise ValueError(msg) from None
        except _DuplicateKeyError as exc:
            msg = f"Deploy config {str(path)!r}: {exc}"
            raise ValueError(msg) from None
        try:
            config = cls.from_dict({} if data is None else data)
            return attrs.evolve(config, source=str(path))
        except MissingKeyError as exc:
            raise MissingKeyError(f"Deploy config {str(path)!r}: {exc}") from None
        except TypeError as exc:
            raise TypeError(f"Deploy config {str(path)!r}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"Deploy config {str(path)!r}: {exc}") from None


@attrs.frozen
class SessionStateSettings:
    """The resolved session-state settings of one process.

    >>> SessionStateSettings(enabled=True, max_sessions=4).max_bytes is None
    True
    """

    enabled: bool
    max_sessions: int = DEFAULT_MAX_SESSIONS
    check_immutable: bool = False
    on_full: OnFull = "evict"
    max_bytes: MaxBytes | None = None
    park_tier: Tier = "host"
    spool_dir: str | None = None
    kv_pool_bytes: int | None = None
    host_pool_bytes: int | None = None
    host_pool_full: HostPoolFull = "disk"
    keep_parked_copies: bool = True


def parse_env_flag(value: str | None, /) -> bool | None:
    """Parse a boolean environment value; None when unset or unparsable.

    Accepts ``1/true/yes/on`` and ``0/false/no/off``, in any case, with surrounding
    whitespace.

    >>> parse_env_flag(" On "), parse_env_flag("0"), parse_env_flag("maybe")
    (True, False, None)
    """
    if value is None:
        return None
    token = value.strip().lower()
    if token in _TRUE:
        return True
    if token in _FALSE:
        return False
    return None


def _parse_positive_int(value: str) -> int | None:
    token = value.strip()
    # Plain ASCII digits only: `int()` would also take "1_000" and non-ASCII digits.
    if not (token.isascii() and token.isdigit()):
        return None
    number = int(token)
    return number if number > 0 else None


def resolve_session_state_config(
    config: OmniDiffusionConfig | None, environ: Mapping[str, str] | None = None
) -> SessionStateSettings:
    """Resolve whether the manager is on, and its session cap, for this process.

    A set ``OMNI_DIFFUSION_SESSION_STATE_MANAGER`` overrides the config field in both
    directions; unset or unparsable falls back to the config (unparsable logs a warning).
    ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS`` sets the cap to a positive int; any
    other value logs a warning naming the variable and the value and is ignored. The cap is
    deliberately not a config field: it mirrors the bespoke path's fixed constant (the default,
    `DEFAULT_MAX_SESSIONS`, is DreamZero's bespoke ``MAX_DREAMZERO_SESSIONS``).
    ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_CHECK_IMMUTABLE`` turns on the manager's in-place
    write check (a debugging aid; off by default).
    ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES`` overrides the config's byte budget (a
    count such as ``24GiB``, or ``cuda:0=24GiB,cpu=8GiB``); an unparsable value logs a warning
    naming the variable and the value and is ignored.
    ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_KV_POOL_BYTES`` overrides the config's
    ``session_state_kv_pool_bytes`` (one positive count such as ``40GiB``); an unparsable or
    zero value logs a warning naming the variable and the value and is ignored;
    ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_HOST_POOL_BYTES`` likewise overrides
    ``session_state_host_pool_bytes``.
    ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL`` (``evict`` or ``refuse``, any case)
    overrides the config's ``session_state_on_full``; unset or empty falls back to the config,
    and any other value logs a warning naming the variable and the value and is ignored.

    Args:
        config: The deploy config (None reads as the defaults).
        environ: The environment to read; ``os.environ`` when None.

    >>> cfg = OmniDiffusionConfig(enable_session_state_manager=True)
    >>> resolve_session_state_config(cfg, {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "off"})
    ... # doctest: +NORMALIZE_WHITESPACE
    SessionStateSettings(enabled=False, max_sessions=64, check_immutable=False,
        on_full='evict', max_bytes=None, park_tier='host', spool_dir=None,
        kv_pool_bytes=None, host_pool_bytes=None, host_pool_full='disk',
        keep_parked_copies=True)
    """
    env = os.environ if environ is None else environ
    enabled = config.enable_session_state_manager if config is not None else False

    raw_flag = env.get(ENV_ENABLE)
    if raw_flag is not None and not raw_flag.strip():
        raw_flag = None  # `VAR=` (empty) reads as unset, as in shell conventions
    flag = parse_env_flag(raw_flag)
    if flag is not None:
        enabled = flag
    elif raw_flag is not None:
        logger.warning(
            "Ignoring %s=%r: expected one of 1/0/true/false/yes/no/on/off; using the config "
            "value enable_session_state_manager=%s.",
            ENV_ENABLE,
            raw_flag,
            enabled,
        )

    max_sessions = DEFAULT_MAX_SESSIONS
    raw_cap = env.get(ENV_MAX_SESSIONS)
    if raw_cap is not None:
        cap = _parse_positive_int(raw_cap)
        if cap is None:
            logger.warning(
                "Ignoring %s=%r: expected a positive int; using the default cap %d.",
                ENV_MAX_SESSIONS,
                raw_cap,
                DEFAULT_MAX_SESSIONS,
            )
        else:
            max_sessions = cap

    check_immutable = False
    raw_check = env.get(ENV_CHECK_IMMUTABLE)
    if raw_check is not None and raw_check.strip():
        parsed = parse_env_flag(raw_check)
        if parsed is None:
            logger.warning(
                "Ignoring %s=%r: expected one of 1/0/true/false/yes/no/on/off; the check "
                "stays off.",
                ENV_CHECK_IMMUTABLE,
                raw_check,
            )
        else:
            check_immutable = parsed
    max_bytes = config.session_state_max_bytes if config is not None else None
    raw_bytes = env.get(ENV_MAX_BYTES)
    if raw_bytes is not None and raw_bytes.strip():
        parsed_bytes = _budget_or_problem(raw_bytes)
        if isinstance(parsed_bytes, str):
            logger.warning(
                "Ignoring %s=%r: %s; using the config value session_state_max_bytes=%r.",
                ENV_MAX_BYTES,
                raw_bytes,
                parsed_bytes,
                max_bytes,
            )
        else:
            max_bytes = parsed_bytes
    if isinstance(max_bytes, Mapping):
        max_bytes = dict(max_bytes)
    on_full = _resolve_on_full(config, env)
    return SessionStateSettings(
        enabled=enabled,
        max_sessions=max_sessions,
        check_immutable=check_immutable,
        on_full=on_full,
        max_bytes=max_bytes,
        park_tier=config.session_state_park_tier if config is not None else "host",
        spool_dir=config.session_state_spool_dir if config is not None else None,
        kv_pool_bytes=_resolve_pool_bytes(config, env, "session_state_kv_pool_bytes"),
        host_pool_bytes=_resolve_pool_bytes(config, env, "session_state_host_pool_bytes"),
        host_pool_full=config.session_state_host_pool_full if config is not None else "disk",
        keep_parked_copies=(
            config.session_state_keep_parked_copies if config is not None else True
        ),
    )


_POOL_BYTES_ENV = {
    "session_state_kv_pool_bytes": ENV_KV_POOL_BYTES,
    "session_state_host_pool_bytes": ENV_HOST_POOL_BYTES,
}


def _resolve_pool_bytes(
    config: OmniDiffusionConfig | None, env: Mapping[str, str], field: str
) -> int | None:
    # A pool's byte figure: the environment's if it parses, else the config's.
    configured: int | None = getattr(config, field) if config is not None else None
    variable = _POOL_BYTES_ENV[field]
    raw = env.get(variable)
    if raw is None or not raw.strip():
        return configured
    try:
        return _positive_budget(raw.strip(), variable)
    except (TypeError, ValueError) as exc:
        logger.warning(
            "Ignoring %s=%r: %s Using the config value %s=%r.",
            variable,
            raw,
            exc,
            field,
            configured,
        )
        return configured


def _resolve_on_full(config: OmniDiffusionConfig | None, env: Mapping[str, str]) -> OnFull:
    on_full: OnFull = config.session_state_on_full if config is not None else "evict"
    raw = env.get(ENV_ON_FULL)
    if raw is None or not raw.strip():
        return on_full
    token = raw.strip().lower()
    for choice in _ON_FULL:
        if token == choice:
            return choice
    logger.warning(
        "Ignoring %s=%r: expected 'evict' or 'refuse'; using the config value "
        "session_state_on_full=%r.",
        ENV_ON_FULL,
        raw,
        on_full,
    )
    return on_full
