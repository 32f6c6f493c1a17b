"""The checks a `LatentBuffer` runs on its configuration and on every chunk it is given."""

from __future__ import annotations

import attrs
import torch

from sessionstate._checks import describe, is_int


def _check_dim(instance: object, attribute: attrs.Attribute[int], dim: object) -> None:
    if not is_int(dim) or dim < 0:
        msg = (
            f"`dim` must be a non-negative int (the chunks' time dimension), got "
            f"{describe(dim)}; count it from the front, e.g. `dim=2` for (B, C, T, H, W)."
        )
        raise ValueError(msg)


def _check_maxlen(maxlen: object) -> int | None:
    if maxlen is None:
        return None
    if not is_int(maxlen) or maxlen <= 0:
        msg = (
            f"`maxlen` must be a positive int or None, got {describe(maxlen)}. "
            "Use `maxlen=None` to keep every chunk, or `maxlen=k` for a ring of the last k."
        )
        raise ValueError(msg)
    return maxlen


def _as_chunks(value: object) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        # `tuple(tensor)` would split it into rows silently.
        msg = (
            f"LatentBuffer `chunks` must be a sequence of tensors, got one tensor of shape "
            f"{tuple(value.shape)}; pass `chunks=(t,)`, or build the buffer with "
            "`.allocate(...)` and `.commit(t)`."
        )
        raise TypeError(msg)
    return tuple(value)  # type: ignore[arg-type]


def _check_chunk(name: str, dim: int, chunk: object, ref: torch.Tensor | None) -> None:
    """Check that ``chunk`` may follow ``ref`` (the newest held chunk) in a buffer."""
    if not isinstance(chunk, torch.Tensor):
        msg = (
            f"LatentBuffer `{name}` holds tensors, got {type(chunk).__name__}; "
            "commit a torch.Tensor."
        )
        raise TypeError(msg)
    if chunk.dim() <= dim:
        msg = (
            f"LatentBuffer `{name}` concatenates along dim {dim}, so a chunk needs "
            f"at least {dim + 1} dims; got shape {tuple(chunk.shape)}. Commit chunks "
            "with the time axis at `dim`, or build the buffer with a matching `dim=`."
        )
        raise ValueError(msg)
    if ref is None:
        return
    if chunk.layout != ref.layout or chunk.is_nested != ref.is_nested:
        msg = (
            f"LatentBuffer `{name}` holds chunks of layout {_layout(ref)}; got layout "
            f"{_layout(chunk)}, which `torch.cat` cannot join with them. Convert the chunk "
            "(`.to_dense()`, `.to_sparse()`) or `reset()` the buffer to change its layout."
        )
        raise ValueError(msg)
    if (
        chunk.dtype != ref.dtype
        or chunk.device != ref.device
        or chunk.dim() != ref.dim()
        or chunk.shape[:dim] != ref.shape[:dim]
        or chunk.shape[dim + 1 :] != ref.shape[dim + 1 :]
    ):
        msg = (
            f"LatentBuffer `{name}` holds chunks of dtype {ref.dtype} on {ref.device} "
            f"with shape {_shape_pattern(ref.shape, dim)}; got dtype {chunk.dtype} on "
            f"{chunk.device} with shape {tuple(chunk.shape)}. Convert the chunk "
            "(`.to(dtype=..., device=...)`) or `reset()` the buffer to change its layout."
        )
        raise ValueError(msg)


def _layout(t: torch.Tensor) -> str:
    return f"{t.layout} (nested)" if t.is_nested else str(t.layout)


def _shape_pattern(shape: torch.Size, dim: int) -> str:
    parts = ["T" if i == dim else str(s) for i, s in enumerate(shape)]
    return f"({', '.join(parts)})"
