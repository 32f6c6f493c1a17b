"""Starting a local Ray cluster with only what session workers need."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["LOCAL_RAY_ENV", "init_local_ray"]

_MIB = 1024 * 1024

#: Environment set (unless already set) before a local cluster starts: no token
#: authentication, no usage-stats reporting, and no memory monitor killing workers on a
#: small shared machine. Every process the cluster starts inherits it.
LOCAL_RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_memory_monitor_refresh_ms": "0",
}


def init_local_ray(
    *, num_cpus: int = 2, object_store_mib: int = 200, **options: Any
) -> dict[str, Any]:
    """Start a local, offline Ray cluster for session workers, unless one is running.

    No dashboard, no log forwarding to the driver, a small object store (session snapshots
    pass through it, one per migration in flight), and the environment in `LOCAL_RAY_ENV`.
    For a real cluster call ``ray.init(address=...)`` yourself instead.

    Args:
        num_cpus: CPUs the local cluster advertises.
        object_store_mib: Size of the shared-memory object store, in MiB.
        **options: Further `ray.init` keyword arguments; they override the defaults.

    Returns:
        The keyword arguments `ray.init` was called with (empty if Ray was running).

    >>> import ray
    >>> kwargs = init_local_ray()  # the `Router` example reuses this cluster
    >>> ray.is_initialized(), kwargs.get("include_dashboard", False)
    (True, False)
    """
    import ray

    if ray.is_initialized():
        return {}
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    kwargs: dict[str, Any] = {
        "num_cpus": num_cpus,
        "include_dashboard": False,
        "object_store_memory": object_store_mib * _MIB,
        "log_to_driver": False,
        "logging_level": "WARNING",
    }
    kwargs.update(options)
    ray.init(**kwargs)
    return kwargs
