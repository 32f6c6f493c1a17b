"""The scripted DreamZero episode across workers, compared with a single-process run."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cluster_episode"]


def cluster_episode(
    *,
    workers: int = 2,
    preset: str = "tiny",
    sessions: int = 6,
    steps: int = 24,
    seed: int = 0,
    migrate_every: int = 5,
) -> dict[str, Any]:
    """Run the scripted episode through a `Router`, migrating as it goes; compare outputs.

    The same episode runs first in this process (one pipeline, one manager); then through
    a router over ``workers`` Ray actors, where after every ``migrate_every``-th call the
    session just stepped moves to the next worker. Every output (actions, video latents,
    reset reason) is compared with `torch.equal`. Both runs use one torch thread. Ray must
    be initialised.

    Returns:
        A report: ``identical``, ``outputs_compared``, ``first_mismatch``, ``migrations``,
        ``workers`` (per-worker sessions and resident bytes at the end) and the arguments.

    >>> from sessionstate.distributed import init_local_ray
    >>> _ = init_local_ray()  # the `Router` example reuses this cluster, then shuts it down
    >>> report = cluster_episode(sessions=1, steps=2, migrate_every=1)
    >>> report["identical"], report["migrations"], report["outputs_compared"]
    (True, 2, 6)
    """
    from sessionstate.distributed._router import Router
    from sessionstate.distributed._worker import DreamZeroFactory
    from sessionstate.models.dreamzero import DreamZeroConfig
    from sessionstate.models.dreamzero.episode import scripted_episode

    factory = DreamZeroFactory(preset=preset)
    cfg = DreamZeroConfig.preset(preset)
    episode = list(scripted_episode(cfg, steps=steps, sessions=sessions, seed=seed))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = factory()
        expected = [pipe.forward(obs, sid) for sid, obs in episode]
    finally:
        torch.set_num_threads(previous)

    router = Router(factory, workers=workers, num_threads=1)
    compared, mismatch = 0, None
    try:
        for i, ((sid, obs), want) in enumerate(zip(episode, expected, strict=True)):
            got = router.step(sid, obs)
            for key in ("actions", "video_latents"):
                compared += 1
                if mismatch is None and not torch.equal(getattr(got, key), getattr(want, key)):
                    mismatch = f"call {i} ({sid}): {key}"
            compared += 1
            if mismatch is None and got.reset != want.reset:
                mismatch = f"call {i} ({sid}): reset {got.reset} vs {want.reset}"
            if migrate_every and (i + 1) % migrate_every == 0 and len(router.workers) > 1:
                live = router.workers
                owner = router.owner(sid)
                router.migrate(sid, live[(live.index(owner) + 1) % len(live)])
        stats = router.stats()
    finally:
        router.shutdown()
    seconds = [m.seconds for m in router.migrations]
    return {
        "identical": mismatch is None,
        "outputs_compared": compared,
        "first_mismatch": mismatch,
        "migrations": len(router.migrations),
        "median_migration_ms": (
            round(1000 * sorted(seconds)[len(seconds) // 2], 3) if seconds else None
        ),
        "workers": {
            name: {
                "sessions": sorted(s.nbytes_by_session),
                "nbytes": s.total_nbytes,
                "steps": s.steps,
            }
            for name, s in stats.items()
        },
        "preset": preset,
        "sessions": sessions,
        "steps": steps,
        "seed": seed,
        "migrate_every": migrate_every,
    }
