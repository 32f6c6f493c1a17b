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

from sessionstate._accounting import nbytes_by_device, nbytes_by_key
from sessionstate._config import (
    ENV_CHECK_IMMUTABLE,
    ENV_ENABLE,
    ENV_MAX_BYTES,
    ENV_MAX_SESSIONS,
    ENV_ON_FULL,
    OmniDiffusionConfig,
    SessionStateSettings,
    parse_env_flag,
    resolve_session_state_config,
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
from sessionstate._kv import EncodeOnceKV, KVPair
from sessionstate._kvpool import KVHandle, KVPool
from sessionstate._manager import DEFAULT_MAX_SESSIONS, SessionStateManager
from sessionstate._movers import to_device
from sessionstate._objects import LatentBuffer, ParkedObject, StateObject, TensorCache
from sessionstate._session import SessionAttr, SessionState
from sessionstate._snapshot import (
    dumps_state,
    load_state,
    loads_state,
    register_snapshot_leaf,
    save_state,
)
from sessionstate._staging import StagedStateObject
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

__version__ = "0.1.0.dev0"

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
