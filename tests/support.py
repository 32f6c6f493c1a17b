"""Helpers shared by the test modules, imported as `tests.support` (tests/ is a package)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from sessionstate import SessionStateManager, tree_map
from sessionstate.models.dreamzero import DreamZeroOutput
from sessionstate.testing import recount_nbytes_by_device

ROOT = Path(__file__).resolve().parents[1]
"""The repository's root."""

DATA = ROOT / "tests" / "data"
"""Committed test data: the golden snapshot files and the script that wrote them."""


def clone_tree(tree: Any) -> Any:
    """A deep copy of every tensor leaf (to detect in-place writes into the original)."""
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def assert_stats_equal_a_recount(manager: SessionStateManager) -> None:
    """``manager.stats()``'s byte keys equal an independent recount of its stored records."""
    records = [manager.peek(sid) for sid in manager.session_ids()]
    recount = recount_nbytes_by_device(records)
    stats = manager.stats()
    assert stats["total_nbytes"] == sum(recount.values())
    assert {k[len("nbytes:") :]: v for k, v in stats.items() if k.startswith("nbytes:")} == recount


def same_output(a: DreamZeroOutput, b: DreamZeroOutput) -> bool:
    """Bit-identical DreamZero outputs: actions, video latents and the reset reason."""
    return (
        torch.equal(a.actions, b.actions)
        and torch.equal(a.video_latents, b.video_latents)
        and a.reset == b.reset
    )


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads, restoring the previous count afterwards.

    Modules pin one thread: the CPUs are shared, one thread avoids oversubscription (and is
    much faster here), and every comparison made inside runs under the same setting.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
