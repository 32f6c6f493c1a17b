"""Shared test configuration: hypothesis profiles (`default` quick, `ci` heavier)."""

from __future__ import annotations

import os
from collections.abc import Iterator

# CPU kernels: the golden snapshot files (`tests/data/snapshots/`) hold model sessions that the
# tests rebuild with seeded networks and compare bit for bit, and float results depend on which
# vector kernels torch and oneDNN pick for the CPU at hand (an AVX-512 machine rounds some
# convolutions and matmuls differently from an AVX2 one). The files were written with the AVX2
# kernels, so every test run uses those, whatever x86 machine it lands on (read by torch and
# oneDNN at first use; set before anything here imports torch; a subprocess inherits them).
# `tests/data/make_golden.py` sets the same. They are not enough everywhere: an AMX machine
# (Sapphire Rapids) still rounds the seeded networks' matmuls and convolutions differently, so
# the golden tests hold model files to bits pinned when they were written, not to a rebuild.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
# One torch thread per pytest-xdist worker: two workers, each with a thread per core, make
# OpenMP's threads wait on each other, and a model test then runs 3-10x slower than alone.
# A test that needs more threads sets them itself (`tests.support.torch_threads`).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# `ci` (what `.ci/run` sets): twice the default's examples, longer state machines. Every
# mutant of `make mutants` is killed at the default's; the suite must stay within its time.
settings.register_profile(
    "ci",
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# -- Ray: one local cluster for the whole run, and the tests that use Ray apart ---------------
#
# Starting a cluster costs seconds; the Ray tests share one. They are marked `ray`: `make
# pytest` runs everything else on two pytest-xdist workers, then the `ray` tests on their own
# (`-m ray`), so the cluster's worker processes never compete with a second test worker for
# the machine's cores (a worker starved of CPU misses the router's timeout). Under xdist they
# also form one group, for a run that does not split them out.

_RAY_PATHS = ("tests/distributed/", "src/sessionstate/distributed/", "cli/_cluster.py")
_RAY_IDS = ("[scaling-out.md]",)  # a docs page whose code starts a local cluster


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the mark
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.as_posix()
        if any(part in path for part in _RAY_PATHS) or any(i in item.nodeid for i in _RAY_IDS):
            item.add_marker(pytest.mark.ray)
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs, started on first use and shut down at the end."""
    import ray

    from sessionstate.distributed import init_local_ray

    init_local_ray(num_cpus=2, object_store_mib=200)
    yield
    ray.shutdown()
