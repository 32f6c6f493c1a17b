"""Which tensors of a record a compiled step may write its successor into: those nothing else holds.

A donated tensor is written in place, so every holder of it, of a view of its storage, or of a
container or record on the way to it would see the write. The check here finds them all by
reference counts, which CPython keeps exactly: it walks the record (records, their instance
dicts, tuples, lists and dicts), counts how often each object is referenced from inside the
walk, and calls an object held from outside when ``sys.getrefcount`` says more. A tensor is
donated only if neither it nor anything on any path to it is held from outside, and no other
tensor shares its storage (the storage's use count). The root record may be held once more:
the caller's own reference, which a donating call consumes (as JAX's ``donate_argnums``).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterable
from typing import Any

import attrs
import torch
import torch.utils._pytree as torch_pytree

__all__ = ["donatable_paths"]

# What the walk descends into: builtin containers, and instances of attrs classes (records, and
# the frozen helpers they hold). Anything else is opaque: never donated through.
_CONTAINERS = (tuple, list, dict)


def _descends(obj: object) -> bool:
    return isinstance(obj, _CONTAINERS) or attrs.has(type(obj))


def _walk(root: object) -> tuple[dict[int, Any], dict[int, int], dict[int, list[int]]]:
    """Every object reachable from ``root`` through containers, how often each is referenced
    from inside, and each container's children (by id)."""
    objs: dict[int, Any] = {id(root): root}
    inside: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        kids = children.setdefault(id(node), [])
        for child in gc.get_referents(node):
            if not (isinstance(child, torch.Tensor) or _descends(child)):
                continue
            key = id(child)
            inside[key] = inside.get(key, 0) + 1
            kids.append(key)
            if key not in objs:
                objs[key] = child
                if not isinstance(child, torch.Tensor):
                    stack.append(child)
    return objs, inside, children


def _held_outside(objs: dict[int, Any], inside: dict[int, int], root_id: int, own: int) -> set[int]:
    held: set[int] = set()
    # What `getrefcount` reports for an object held once, by a dict (as `objs` holds each):
    # the references the expression itself takes, measured rather than assumed.
    marker = {0: object()}
    once = sys.getrefcount(marker[0])
    for key in objs:
        if type(objs[key]) in _CONTAINERS and not objs[key]:
            continue  # an empty container holds no tensor (and `()` is shared by everyone)
        outside = sys.getrefcount(objs[key]) - once - inside.get(key, 0)
        if key == root_id:
            outside -= own
        if outside > 0:
            held.add(key)
    return held


def _reachable(starts: Iterable[int], children: dict[int, list[int]]) -> set[int]:
    seen = set(starts)
    stack = list(seen)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


def _storage_uses(t: torch.Tensor) -> int:
    # The temporary storage object holds one use itself.
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata)) - 1


def donatable_paths(root: object, own: int, others: Iterable[object] = ()) -> tuple[str, ...]:
    """The key paths (``torch.utils._pytree.keystr``) of ``root``'s donatable tensor leaves.

    ``own`` counts the references to ``root`` the calling frames hold (this function's own
    parameter aside) besides the one reference a donating call consumes. ``others`` are
    the call's other arguments: a tensor of theirs that shares a storage with a leaf keeps
    that leaf from being donated.
    """
    objs, inside, children = _walk(root)
    # Besides `own`: this frame's `root`, and the caller's reference a donating call consumes.
    held = _held_outside(objs, inside, id(root), own + 2)
    seen_from_outside = _reachable(held, children)
    other_storages = {
        t.untyped_storage().data_ptr()
        for t in torch_pytree.tree_leaves(tuple(others))
        if isinstance(t, torch.Tensor)
    }
    items = torch_pytree.tree_flatten_with_path(root)[0]
    at_paths: dict[int, int] = {}
    for _, leaf in items:
        at_paths[id(leaf)] = at_paths.get(id(leaf), 0) + 1
    paths: list[str] = []
    for path, leaf in items:
        if not isinstance(leaf, torch.Tensor) or id(leaf) in seen_from_outside:
            continue
        if at_paths[id(leaf)] != 1:  # one tensor at two places: one write would reach both
            continue
        if (
            leaf.requires_grad
            or not leaf.is_contiguous()
            or leaf.device.type == "meta"
            or _storage_uses(leaf) != 1
            or leaf.untyped_storage().data_ptr() in other_storages
        ):
            continue
        paths.append(torch_pytree.keystr(path))
    del objs
    return tuple(paths)
