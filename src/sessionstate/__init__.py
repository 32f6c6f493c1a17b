"""Immutable, typed per-session state for autoregressive diffusion world models.

Models thread an immutable record through ``step(state, inputs) -> (state, out)``; a thin
`SessionStateManager` keeps the latest record per session under an LRU cap and reports the
bytes every session holds, per device.

>>> import torch, sessionstate as ss
>>> manager = ss.SessionStateManager(max_sessions=4)
>>> state = manager.get_or_create("cam-1", ss.SessionState)
>>> manager.put("cam-1", state.with_attrs(latent=torch.zeros(8)))
>>> manager.stats()["nbytes:cpu"]
32
"""

import importlib.metadata

# The names below load on first use (PEP 562), so that `import sessionstate` stays light and
# `sessionstate --help` answers without importing torch; type checkers and the docs read the
# imports under TYPE_CHECKING.
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sessionstate._accounting import nbytes_by_device, nbytes_by_key
    from sessionstate._config import (
        OmniDiffusionConfig,
        SessionStateSettings,
        parse_env_flag,
        resolve_session_state_config,
    )
    from sessionstate._env import (
        ENV_CHECK_IMMUTABLE,
        ENV_ENABLE,
        ENV_MAX_BYTES,
        ENV_MAX_SESSIONS,
        ENV_ON_FULL,
    )
    from sessionstate._errors import (
        ImmutabilityViolationError,
        ImmutableRecordError,
        IncompleteStateError,
        KVPoolExhaustedError,
        MissingKeyError,
        NotAllocatedError,
        ParkedError,
        ParkingError,
        SessionAdmissionError,
        SessionStateLostError,
        SnapshotError,
        StaleKVHandleError,
        UnsupportedTensorError,
    )
    from sessionstate._kv import EncodeOnceKV, KVHandle, KVPair, KVPool
    from sessionstate._manager import DEFAULT_MAX_SESSIONS, SessionStateManager
    from sessionstate._movers import to_device
    from sessionstate._objects import LatentBuffer, ParkedObject, StateObject, TensorCache
    from sessionstate._session import SessionAttr, SessionState
    from sessionstate._staging import StagedStateObject
    from sessionstate._storage import (
        dumps_state,
        load_state,
        loads_state,
        register_snapshot_leaf,
        save_state,
    )
    from sessionstate._tree import (
        NAMESPACE,
        PyTree,
        field,
        record,
        register_record,
        static_field,
        tree_equal,
        tree_flatten,
        tree_flatten_with_keys,
        tree_leaves,
        tree_map,
        tree_unflatten,
    )

__version__ = importlib.metadata.version("sessionstate")  # one place: pyproject.toml

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "ENV_CHECK_IMMUTABLE",
    "ENV_ENABLE",
    "ENV_MAX_BYTES",
    "ENV_MAX_SESSIONS",
    "ENV_ON_FULL",
    "NAMESPACE",
    "EncodeOnceKV",
    "ImmutabilityViolationError",
    "ImmutableRecordError",
    "IncompleteStateError",
    "KVHandle",
    "KVPair",
    "KVPool",
    "KVPoolExhaustedError",
    "LatentBuffer",
    "MissingKeyError",
    "NotAllocatedError",
    "OmniDiffusionConfig",
    "ParkedError",
    "ParkedObject",
    "ParkingError",
    "PyTree",
    "SessionAdmissionError",
    "SessionAttr",
    "SessionState",
    "SessionStateLostError",
    "SessionStateManager",
    "SessionStateSettings",
    "SnapshotError",
    "StagedStateObject",
    "StaleKVHandleError",
    "StateObject",
    "TensorCache",
    "UnsupportedTensorError",
    "__version__",
    "dumps_state",
    "field",
    "load_state",
    "loads_state",
    "nbytes_by_device",
    "nbytes_by_key",
    "parse_env_flag",
    "record",
    "register_record",
    "register_snapshot_leaf",
    "resolve_session_state_config",
    "save_state",
    "static_field",
    "to_device",
    "tree_equal",
    "tree_flatten",
    "tree_flatten_with_keys",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

_LAZY: dict[str, str] = {
    "nbytes_by_device": "sessionstate._accounting",
    "nbytes_by_key": "sessionstate._accounting",
    "ENV_CHECK_IMMUTABLE": "sessionstate._env",
    "ENV_ENABLE": "sessionstate._env",
    "ENV_MAX_BYTES": "sessionstate._env",
    "ENV_MAX_SESSIONS": "sessionstate._env",
    "ENV_ON_FULL": "sessionstate._env",
    "OmniDiffusionConfig": "sessionstate._config",
    "SessionStateSettings": "sessionstate._config",
    "parse_env_flag": "sessionstate._config",
    "resolve_session_state_config": "sessionstate._config",
    "ImmutabilityViolationError": "sessionstate._errors",
    "ImmutableRecordError": "sessionstate._errors",
    "IncompleteStateError": "sessionstate._errors",
    "KVPoolExhaustedError": "sessionstate._errors",
    "MissingKeyError": "sessionstate._errors",
    "NotAllocatedError": "sessionstate._errors",
    "ParkedError": "sessionstate._errors",
    "ParkingError": "sessionstate._errors",
    "SessionAdmissionError": "sessionstate._errors",
    "SessionStateLostError": "sessionstate._errors",
    "SnapshotError": "sessionstate._errors",
    "StaleKVHandleError": "sessionstate._errors",
    "UnsupportedTensorError": "sessionstate._errors",
    "EncodeOnceKV": "sessionstate._kv",
    "KVPair": "sessionstate._kv",
    "KVHandle": "sessionstate._kv",
    "KVPool": "sessionstate._kv",
    "DEFAULT_MAX_SESSIONS": "sessionstate._manager",
    "SessionStateManager": "sessionstate._manager",
    "to_device": "sessionstate._movers",
    "LatentBuffer": "sessionstate._objects",
    "ParkedObject": "sessionstate._objects",
    "StateObject": "sessionstate._objects",
    "TensorCache": "sessionstate._objects",
    "SessionAttr": "sessionstate._session",
    "SessionState": "sessionstate._session",
    "dumps_state": "sessionstate._storage",
    "load_state": "sessionstate._storage",
    "loads_state": "sessionstate._storage",
    "register_snapshot_leaf": "sessionstate._storage",
    "save_state": "sessionstate._storage",
    "StagedStateObject": "sessionstate._staging",
    "NAMESPACE": "sessionstate._tree",
    "PyTree": "sessionstate._tree",
    "field": "sessionstate._tree",
    "record": "sessionstate._tree",
    "register_record": "sessionstate._tree",
    "static_field": "sessionstate._tree",
    "tree_equal": "sessionstate._tree",
    "tree_flatten": "sessionstate._tree",
    "tree_flatten_with_keys": "sessionstate._tree",
    "tree_leaves": "sessionstate._tree",
    "tree_map": "sessionstate._tree",
    "tree_unflatten": "sessionstate._tree",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'sessionstate' has no attribute {name!r}"
        raise AttributeError(msg)
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
