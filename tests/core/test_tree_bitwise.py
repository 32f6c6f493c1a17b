"""`tree_equal` is bitwise for tensors inside records: never close, never merely `==`.

For every floating dtype, it tells apart values one ulp apart, ``0.0`` and ``-0.0``, and two
NaNs whose payload bits differ, whether the tensor is a record attribute, a chunk inside a
`LatentBuffer`, or a record nested in a container; and it still equals a bitwise copy.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sessionstate import LatentBuffer, SessionState, tree_equal

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _nan_payloads(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two quiet NaNs of ``dtype`` that differ only in their lowest payload bit."""
    quiet = torch.tensor([float("nan")], dtype=dtype)
    bits = quiet.view(_INT_OF_WIDTH[quiet.element_size()])
    other = (bits | 1).view(dtype)
    assert torch.isnan(other).all()
    assert not torch.equal(bits, other.view(bits.dtype))
    return quiet, other


def _pairs(dtype: torch.dtype) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    one = torch.tensor([1.0, 2.5, -3.0], dtype=dtype)
    next_up = one.clone()
    next_up[1] = torch.nextafter(one[1:2], torch.tensor([float("inf")], dtype=dtype))[0]
    zero, negative_zero = torch.zeros(3, dtype=dtype), torch.zeros(3, dtype=dtype).neg()
    nan_a, nan_b = _nan_payloads(dtype)
    return [
        ("one ulp apart", one, next_up),
        ("0.0 and -0.0", zero, negative_zero),
        ("NaN payloads", nan_a, nan_b),
    ]


def _as_attr(t: torch.Tensor) -> Any:
    return SessionState(attrs={"x": t, "step": 3})


def _as_chunk(t: torch.Tensor) -> Any:
    ring = LatentBuffer(name="ring", dim=0).allocate(maxlen=2).commit(torch.ones(3, dtype=t.dtype))
    return SessionState(objects={"ring": ring.commit(t)})


def _nested(t: torch.Tensor) -> Any:
    return {"sessions": [_as_attr(torch.zeros(1)), _as_chunk(t)], "n": 1}


PLACES = [
    pytest.param(_as_attr, id="attr"),
    pytest.param(_as_chunk, id="ring-chunk"),
    pytest.param(_nested, id="nested"),
]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_tree_equal_tells_apart_what_close_comparisons_merge(
    dtype: torch.dtype, place: Any
) -> None:
    for what, a, b in _pairs(dtype):
        # The two tensors are within one ulp (or NaN in the same places); their bits differ.
        eps = torch.finfo(dtype).eps
        assert torch.allclose(a, b, rtol=eps, atol=0.0, equal_nan=True), what
        assert not tree_equal(place(a), place(b)), what
        assert not tree_equal(place(b), place(a)), what
        assert tree_equal(place(a), place(a.clone())), what
        assert tree_equal(place(b), place(b.clone())), what


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_tree_equal_is_bitwise_for_complex_parts(dtype: torch.dtype) -> None:
    real = torch.tensor([1.0, 0.0], dtype=dtype)
    signed = torch.complex(real.real, torch.zeros(2, dtype=real.real.dtype).neg())
    assert torch.equal(real, signed)  # `==` cannot see the sign of a zero imaginary part
    assert not tree_equal(_as_attr(real), _as_attr(signed))
    assert tree_equal(_as_attr(signed), _as_attr(signed.clone()))
