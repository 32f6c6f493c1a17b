"""Helpers shared by the test modules, imported as `tests.support` (tests/ is a package)."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import xxhash

from sessionstate import (
    ENV_CHECK_IMMUTABLE,
    ENV_ENABLE,
    ENV_MAX_SESSIONS,
    KVCache,
    KVHandle,
    LatentBuffer,
    SessionState,
    SessionStateManager,
    TensorCache,
    tree_leaves,
    tree_map,
)
from sessionstate.models.dreamzero import DreamZeroOutput
from sessionstate.testing import recount_nbytes_by_device

ROOT = Path(__file__).resolve().parents[1]
"""The repository's root."""

DATA = ROOT / "tests" / "data"
"""Committed test data: the golden snapshot files and the script that wrote them."""


def load_module(path: Path, name: str, *, register: bool = False) -> ModuleType:
    """The module in the file ``path``, run under ``name``: a script, a tool, a test module.

    With ``register``, it is in `sys.modules` while it runs (dataclasses look their module
    up there). Under a name of its own, pytest does not collect a test module a second time.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python -m sessionstate.cli ARGS`` in a subprocess, one torch thread, none of the
    library's environment switches inherited (``timeout``: a hang guard only)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in (ENV_ENABLE, ENV_MAX_SESSIONS, ENV_CHECK_IMMUTABLE):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "sessionstate.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


# -- records to park, and how their tensors alias ------------------------------------------


def parkable_record(n: int = 16, fill: float = 1.0) -> SessionState:
    """A `TensorCache` (a tensor, a view of it and a None) and a ring of two: what parking
    moves. Every record the same size (float32, whatever ``fill``)."""
    fill = float(fill)
    base = torch.full((n,), fill)
    cache = TensorCache(name="cache").allocate().commit((base, base[2:], None))
    ring = LatentBuffer(name="ring", dim=0).allocate(maxlen=2).commit(torch.arange(4.0) + fill)
    return SessionState(objects={"cache": cache, "ring": ring}, attrs={"step": 1})


def kv_of(record: SessionState, name: str = "kv") -> torch.Tensor:
    """The tokens the record's `KVCache` ``name`` holds (it must hold some)."""
    kv = record.object(name, KVCache).read()
    assert kv is not None
    return kv


def handle_of(record: SessionState, name: str = "kv") -> KVHandle:
    """The `KVHandle` of the record's `KVCache` ``name`` (it must hold one)."""
    handle = record.object(name, KVCache).view()
    assert handle is not None
    return handle


def alias_graph(record: Any) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """Each tensor leaf as (storage number in order of first use, offset, shape, stride)."""
    numbers: dict[int, int] = {}
    out = []
    for leaf in tree_leaves(record):
        if isinstance(leaf, torch.Tensor):
            number = numbers.setdefault(leaf.untyped_storage()._cdata, len(numbers))
            out.append((number, leaf.storage_offset(), tuple(leaf.shape), tuple(leaf.stride())))
    return out


# -- forged snapshot files: a document or header edited, its checksums signed again ---------


def split_header(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A snapshot's safetensors header, parsed, and the bytes after it."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_header(header_text: str, body: bytes) -> bytes:
    """A snapshot of header ``header_text`` (JSON) and the bytes after it."""
    encoded = header_text.encode()
    return struct.pack("<Q", len(encoded)) + encoded + body


def xxh3_hex(data: bytes) -> str:
    """The xxh3-64 of ``data`` as a snapshot writes it: 16 hex digits."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def sign(meta: dict[str, str], text: str) -> None:
    """Write again every checksum of the document ``text`` that ``meta`` holds."""
    if "sessionstate.xxh3" in meta:
        meta["sessionstate.xxh3"] = xxh3_hex(text.encode())
    if "sessionstate.crc32" in meta:
        meta["sessionstate.crc32"] = str(zlib.crc32(text.encode()))


def rewrite_text(data: bytes, edit: Callable[[str], str], *, sign_it: bool = True) -> bytes:
    """``data`` with its JSON document's text edited; its checksums written again if asked."""
    header, body = split_header(data)
    text = edit(header["__metadata__"]["sessionstate"])
    header["__metadata__"]["sessionstate"] = text
    if sign_it:
        sign(header["__metadata__"], text)
    return join_header(json.dumps(header), body)


def rewrite(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """``data`` with its JSON document edited by ``edit`` and signed again."""

    def apply(text: str) -> str:
        document = json.loads(text)
        edit(document)
        return json.dumps(document)

    return rewrite_text(data, apply)


def rewrite_header(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """``data`` with its safetensors header (the storage entries) edited by ``edit``."""
    header, body = split_header(data)
    edit(header)
    return join_header(json.dumps(header), body)
