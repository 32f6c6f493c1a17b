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
# `sessionstate --help` answers without importing torch. `_PUBLIC` is the one table of them:
# `__all__` and the lazy lookup come from it, and the imports under TYPE_CHECKING (what type
# checkers and the docs read) are held to it by `tests/meta/test_public_api.py`.
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sessionstate._accounting import nbytes_by_device as nbytes_by_device
    from sessionstate._accounting import nbytes_by_key as nbytes_by_key
    from sessionstate._batch import Batch as Batch
    from sessionstate._batch import stack as stack
    from sessionstate._batch import unstack as unstack
    from sessionstate._batch import vmap as vmap
    from sessionstate._compile import CompiledStep as CompiledStep
    from sessionstate._compile import compile as compile
    from sessionstate._config import OmniDiffusionConfig as OmniDiffusionConfig
    from sessionstate._config import SessionStateSettings as SessionStateSettings
    from sessionstate._config import resolve_session_state_config as resolve_session_state_config
    from sessionstate._env import ENV_CHECK_IMMUTABLE as ENV_CHECK_IMMUTABLE
    from sessionstate._env import ENV_ENABLE as ENV_ENABLE
    from sessionstate._env import ENV_HOST_POOL_BYTES as ENV_HOST_POOL_BYTES
    from sessionstate._env import ENV_KV_POOL_BYTES as ENV_KV_POOL_BYTES
    from sessionstate._env import ENV_MAX_BYTES as ENV_MAX_BYTES
    from sessionstate._env import ENV_MAX_SESSIONS as ENV_MAX_SESSIONS
    from sessionstate._env import ENV_ON_FULL as ENV_ON_FULL
    from sessionstate._errors import BudgetTextError as BudgetTextError
    from sessionstate._errors import DonatedRecordError as DonatedRecordError
    from sessionstate._errors import HostPoolFullError as HostPoolFullError
    from sessionstate._errors import ImmutabilityViolationError as ImmutabilityViolationError
    from sessionstate._errors import ImmutableRecordError as ImmutableRecordError
    from sessionstate._errors import IncompleteStateError as IncompleteStateError
    from sessionstate._errors import KVPoolExhaustedError as KVPoolExhaustedError
    from sessionstate._errors import MissingKeyError as MissingKeyError
    from sessionstate._errors import NotAllocatedError as NotAllocatedError
    from sessionstate._errors import ParkedError as ParkedError
    from sessionstate._errors import ParkingError as ParkingError
    from sessionstate._errors import RecompileLimitError as RecompileLimitError
    from sessionstate._errors import SessionAdmissionError as SessionAdmissionError
    from sessionstate._errors import SessionStateLostError as SessionStateLostError
    from sessionstate._errors import SnapshotError as SnapshotError
    from sessionstate._errors import StaleKVHandleError as StaleKVHandleError
    from sessionstate._errors import UnsupportedTensorError as UnsupportedTensorError
    from sessionstate._kv import EncodeOnceKV as EncodeOnceKV
    from sessionstate._kv import GatheredKV as GatheredKV
    from sessionstate._kv import KVCache as KVCache
    from sessionstate._kv import KVHandle as KVHandle
    from sessionstate._kv import KVPair as KVPair
    from sessionstate._kv import KVPool as KVPool
    from sessionstate._manager import DEFAULT_MAX_SESSIONS as DEFAULT_MAX_SESSIONS
    from sessionstate._manager import SessionStateManager as SessionStateManager
    from sessionstate._manager._events import SessionEvent as SessionEvent
    from sessionstate._objects import LatentBuffer as LatentBuffer
    from sessionstate._objects import TensorCache as TensorCache
    from sessionstate._protocols import DeferredRead as DeferredRead
    from sessionstate._protocols import Derivation as Derivation
    from sessionstate._protocols import DerivesFromBase as DerivesFromBase
    from sessionstate._protocols import EnginePool as EnginePool
    from sessionstate._protocols import NamesItsTransition as NamesItsTransition
    from sessionstate._protocols import OffloadsStorages as OffloadsStorages
    from sessionstate._protocols import ReportsStorages as ReportsStorages
    from sessionstate._protocols import SnapshotLeaf as SnapshotLeaf
    from sessionstate._protocols import StorageEntry as StorageEntry
    from sessionstate._random import RandomKey as RandomKey
    from sessionstate._session import SessionAttr as SessionAttr
    from sessionstate._session import SessionState as SessionState
    from sessionstate._stateobject import ParkedObject as ParkedObject
    from sessionstate._stateobject import StagedStateObject as StagedStateObject
    from sessionstate._stateobject import StateObject as StateObject
    from sessionstate._storage import HostBufferPool as HostBufferPool
    from sessionstate._storage import dumps_state as dumps_state
    from sessionstate._storage import load_state as load_state
    from sessionstate._storage import loads_state as loads_state
    from sessionstate._storage import register_snapshot_leaf as register_snapshot_leaf
    from sessionstate._storage import save_state as save_state
    from sessionstate._storage import to_device as to_device
    from sessionstate._tree import NAMESPACE as NAMESPACE
    from sessionstate._tree import PyTree as PyTree
    from sessionstate._tree import field as field
    from sessionstate._tree import record as record
    from sessionstate._tree import register_record as register_record
    from sessionstate._tree import static_field as static_field
    from sessionstate._tree import tree_equal as tree_equal
    from sessionstate._tree import tree_flatten as tree_flatten
    from sessionstate._tree import tree_flatten_with_keys as tree_flatten_with_keys
    from sessionstate._tree import tree_leaves as tree_leaves
    from sessionstate._tree import tree_map as tree_map
    from sessionstate._tree import tree_unflatten as tree_unflatten

__version__ = importlib.metadata.version("sessionstate")  # one place: pyproject.toml

_PUBLIC: dict[str, tuple[str, ...]] = {
    # -- records and trees ---------------------------------------------------------------
    "sessionstate._tree": (
        "field",
        "NAMESPACE",
        "PyTree",
        "record",
        "register_record",
        "static_field",
        "tree_equal",
        "tree_flatten",
        "tree_flatten_with_keys",
        "tree_leaves",
        "tree_map",
        "tree_unflatten",
    ),
    # -- batches: many records, one forward -----------------------------------------------
    "sessionstate._batch": (
        "Batch",
        "stack",
        "unstack",
        "vmap",
    ),
    # -- compiled steps: a whole step under torch.compile, donation -----------------------
    "sessionstate._compile": (
        "CompiledStep",
        "compile",
    ),
    # -- sessions and state objects ------------------------------------------------------
    "sessionstate._session": (
        "SessionAttr",
        "SessionState",
    ),
    "sessionstate._stateobject": (
        "ParkedObject",
        "StagedStateObject",
        "StateObject",
    ),
    "sessionstate._objects": (
        "LatentBuffer",
        "TensorCache",
    ),
    "sessionstate._random": ("RandomKey",),
    # -- K/V -----------------------------------------------------------------------------
    "sessionstate._kv": (
        "EncodeOnceKV",
        "GatheredKV",
        "KVCache",
        "KVHandle",
        "KVPair",
        "KVPool",
    ),
    # -- the manager and its byte accounting ---------------------------------------------
    "sessionstate._manager": (
        "DEFAULT_MAX_SESSIONS",
        "SessionStateManager",
    ),
    "sessionstate._accounting": (
        "nbytes_by_device",
        "nbytes_by_key",
    ),
    "sessionstate._manager._events": ("SessionEvent",),
    # -- snapshots, devices and the host tier --------------------------------------------
    "sessionstate._storage": (
        "HostBufferPool",
        "dumps_state",
        "load_state",
        "loads_state",
        "register_snapshot_leaf",
        "save_state",
        "to_device",
    ),
    # -- deploy configuration and its environment variables ------------------------------
    "sessionstate._config": (
        "OmniDiffusionConfig",
        "resolve_session_state_config",
        "SessionStateSettings",
    ),
    "sessionstate._env": (
        "ENV_CHECK_IMMUTABLE",
        "ENV_ENABLE",
        "ENV_HOST_POOL_BYTES",
        "ENV_KV_POOL_BYTES",
        "ENV_MAX_BYTES",
        "ENV_MAX_SESSIONS",
        "ENV_ON_FULL",
    ),
    # -- extension points ----------------------------------------------------------------
    "sessionstate._protocols": (
        "DeferredRead",
        "Derivation",
        "DerivesFromBase",
        "EnginePool",
        "NamesItsTransition",
        "OffloadsStorages",
        "ReportsStorages",
        "SnapshotLeaf",
        "StorageEntry",
    ),
    # -- errors --------------------------------------------------------------------------
    "sessionstate._errors": (
        "BudgetTextError",
        "DonatedRecordError",
        "HostPoolFullError",
        "ImmutabilityViolationError",
        "ImmutableRecordError",
        "IncompleteStateError",
        "KVPoolExhaustedError",
        "MissingKeyError",
        "NotAllocatedError",
        "ParkedError",
        "ParkingError",
        "RecompileLimitError",
        "SessionAdmissionError",
        "SessionStateLostError",
        "SnapshotError",
        "StaleKVHandleError",
        "UnsupportedTensorError",
    ),
}
"""Every public name, by the private module that defines it."""

_LAZY: dict[str, str] = {name: module for module, names in _PUBLIC.items() for name in names}

__all__ = sorted([*_LAZY, "__version__"])

_DEPRECATED: dict[str, tuple[str, str]] = {
    "parse_env_flag": (
        "sessionstate._config",
        "`sessionstate.parse_env_flag` is deprecated and will be removed: it is the deploy "
        "config's internal reading of an environment flag. Set the flag and read the result "
        "from `resolve_session_state_config(...)`.",
    ),
}
"""Names that left the public face, still served for a while, with a warning."""


def __getattr__(name: str) -> Any:
    import importlib

    if name in _DEPRECATED:
        import warnings

        where, msg = _DEPRECATED[name]
        warnings.warn(msg, DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), name)
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'sessionstate' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
