"""A snapshot described from its header alone, for `sessionstate inspect`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from sessionstate._storage._decode import (
    read_header,
)

# -- inspection -----------------------------------------------------------------------------------


def inspect_snapshot(path: str | os.PathLike[str], /) -> dict[str, Any]:
    """Describe a snapshot file from its header alone (no tensor bytes are read).

    Returns a JSON-ready dict: the format and versions, the caller's metadata, the storages,
    and one row per top-level value (a session's named objects and attrs, a record's fields,
    a dict's keys, or, for a family written by `SessionStateManager.snapshot_many`, each
    session by its id) with its structure and the bytes it holds per device. A storage reached
    by two values is counted for the first, as `SessionState.nbytes_by_value` does.

    Tensors are counted as references, the way every count here is made (``tensors``, and
    the counts in the structures): a tensor two sessions of a family share counts once per
    session, and the tensors a K/V leaf holds count too. ``views`` and ``storages`` say how
    many distinct ones the references reach.

    Raises:
        SnapshotError: as `load_state`, for a file that is not a readable snapshot.

    >>> import os, tempfile, torch
    >>> from sessionstate import SessionState, save_state
    >>> path = os.path.join(tempfile.mkdtemp(), "s.safetensors")
    >>> save_state(SessionState(attrs={"x": torch.zeros(4), "step": 2}), path)
    >>> [(row["name"], row["nbytes"]) for row in inspect_snapshot(path)["values"]]
    [('x', {'cpu': 16}), ('step', {})]
    """
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        # Checked there as for a load: every reference below is valid.
        document = read_header(f"`{os.fspath(path)}`", stream, size).raw
    storages = document["storages"]
    views = document["views"]
    tree = document["tree"]
    leaves = document.get("leaves", {})
    seen: set[int] = set()

    def row(name: str, bucket: str, node: Any) -> dict[str, Any]:
        nbytes: dict[str, int] = {}
        indices = [views[i]["storage"] for i in _view_indices(node, leaves)]
        for s in indices:
            if s in seen:
                continue
            seen.add(s)
            device = storages[s].get("device", "cpu")
            nbytes[device] = nbytes.get(device, 0) + int(storages[s]["nbytes"])
        return {
            "name": name,
            "bucket": bucket,
            "structure": _structure(node, views, leaves=leaves),
            "tensors": len(indices),
            "nbytes": nbytes,
        }

    rows: list[dict[str, Any]] = []
    fields = tree.get("fields", {}) if tree.get("type") == "record" else {}
    buckets = [
        (b, fields[b])
        for b in ("objects", "attrs")
        if fields.get(b, {}).get("type") in ("dict", "frozendict")
    ]
    ids = _family_ids(document.get("metadata", {}), tree)
    if ids is not None:  # a family (`snapshot_many`): one row per session
        rows.extend(
            row(sid, "session", child) for sid, child in zip(ids, tree["items"], strict=True)
        )
    elif len(buckets) == 2:  # a SessionState: one row per named value
        for bucket, node in buckets:
            rows.extend(row(str(k), bucket, child) for k, child in node["items"])
    elif tree.get("type") == "record":
        rows.extend(row(k, "field", child) for k, child in fields.items())
    elif tree.get("type") in ("dict", "frozendict"):
        rows.extend(row(str(k), "key", child) for k, child in tree["items"])
    else:
        rows.append(row("<root>", "root", tree))
    totals: dict[str, int] = {}
    for described in storages:
        device = described.get("device", "cpu")
        totals[device] = totals.get(device, 0) + int(described["nbytes"])
    return {
        "file": os.fspath(path),
        "file_nbytes": size,
        "format_version": document["format_version"],
        "library_version": document.get("library_version"),
        "torch_version": document.get("torch_version"),
        "metadata": document.get("metadata", {}),
        "root": _structure(tree, views, depth=0, leaves=leaves),
        "tensors": len(_view_indices(tree, leaves)),
        "views": len(views),
        "storages": storages,
        "values": rows,
        "nbytes": totals,
    }


def _family_ids(metadata: Mapping[str, Any], tree: Any) -> list[str] | None:
    """The session ids of a family file (a list root, one id per item), else None."""
    if not isinstance(tree, dict) or tree.get("type") != "list":
        return None
    try:
        ids = json.loads(str(metadata.get("session_ids")))
    except ValueError:
        return None
    if not isinstance(ids, list) or len(ids) != len(tree["items"]):
        return None
    return [str(sid) for sid in ids]


def _view_indices(node: Any, leaves: Mapping[str, Any] | None = None) -> list[int]:
    if not isinstance(node, dict):
        return []
    kind = node.get("type")
    if kind == "tensor":
        return [node["view"]]
    if kind in ("tuple", "list"):
        return [i for child in node["items"] for i in _view_indices(child, leaves)]
    if kind in ("dict", "frozendict"):
        return [i for _, child in node["items"] for i in _view_indices(child, leaves)]
    if kind == "record":
        return [i for child in node["fields"].values() for i in _view_indices(child, leaves)]
    if kind == "leaf" and leaves:  # every storage its class's payload holds
        return _view_indices(leaves.get(str(node.get("class"))), None)
    return []


def _structure(
    node: Any, views: Sequence[Any], depth: int = 1, leaves: Mapping[str, Any] | None = None
) -> str:
    kind = node.get("type") if isinstance(node, dict) else None
    if kind == "none":
        return "None"
    if kind in ("bool", "int", "float", "str"):
        return repr(node["value"])
    if kind == "tensor":
        view = views[node["view"]]
        return f"{view['dtype']}{list(view['shape'])}"
    if kind in ("tuple", "list"):
        items = node["items"]
        tensors = len(_view_indices(node, leaves))
        return f"{kind} of {len(items)}" + (f" ({tensors} tensors)" if tensors else "")
    if kind in ("dict", "frozendict"):
        return f"dict of {len(node['items'])}"
    if kind == "record":
        name = str(node["class"]).rpartition(":")[2]
        statics = ", ".join(f"{k}={_structure(v, views)}" for k, v in node["static"].items())
        tensors = len(_view_indices(node, leaves))
        return f"{name}({statics})" + (f" ({tensors} tensors)" if tensors and depth else "")
    if kind == "leaf":
        return str(node.get("class")).rpartition(":")[2]
    return "?"
