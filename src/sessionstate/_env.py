"""The names of the environment variables that override the deploy config per process.

Kept free of torch so that the command line can name them in its ``--help``.
"""

from __future__ import annotations

__all__ = [
    "ENV_CHECK_IMMUTABLE",
    "ENV_ENABLE",
    "ENV_MAX_BYTES",
    "ENV_MAX_SESSIONS",
    "ENV_ON_FULL",
]

ENV_ENABLE = "OMNI_DIFFUSION_SESSION_STATE_MANAGER"
ENV_MAX_SESSIONS = "OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS"
ENV_CHECK_IMMUTABLE = "OMNI_DIFFUSION_SESSION_STATE_MANAGER_CHECK_IMMUTABLE"
ENV_MAX_BYTES = "OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES"
ENV_ON_FULL = "OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL"
