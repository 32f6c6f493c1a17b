"""Shared test configuration: hypothesis profiles (`default` quick, `ci` heavier)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# -- Ray: one local cluster for the whole run, and every test that uses Ray on one worker ------
#
# Starting a cluster costs seconds; the Ray modules share one. Under pytest-xdist
# (`make pytest` runs two workers) the tests and doctests that reach Ray form one group, so
# one worker runs them all, in collection order, beside that one cluster.

_RAY_MODULES = ("tests/test_distributed", "src/sessionstate/distributed/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.as_posix()
        if any(part in path for part in _RAY_MODULES):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs, started on first use and shut down at the end."""
    import ray

    from sessionstate.distributed import init_local_ray

    init_local_ray(num_cpus=2, object_store_mib=200)
    yield
    ray.shutdown()
