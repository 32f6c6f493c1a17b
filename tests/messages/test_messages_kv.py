"""Every user-facing message of EncodeOnceKV, KVPair, the Cosmos3 model and the model
registry, pinned word for word."""

from __future__ import annotations

import re

import pytest
import torch

from sessionstate import EncodeOnceKV, IncompleteStateError, KVPair, NotAllocatedError
from sessionstate.models._registry import get_model
from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline


def _exact(message: str) -> str:
    return re.escape(message)


def _pair() -> KVPair:
    return KVPair(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def _kv(num_layers: int = 3) -> EncodeOnceKV:
    return EncodeOnceKV(name="text_kv").allocate(num_layers=num_layers)


def test_kvpair_not_a_tensor() -> None:
    msg = (
        "`KVPair.key` must be a torch.Tensor, got int; build the pair from the layer's key "
        "and value tensors."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        KVPair(3, torch.zeros(1))  # type: ignore[arg-type]


def test_kvpair_mismatch() -> None:
    msg = (
        "`KVPair` key and value must agree on shape, dtype and device; got key (2,) "
        "torch.float32 on cpu and value (3,) torch.float32 on cpu. Pass the key and value of "
        "the same layer."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        KVPair(torch.zeros(2), torch.zeros(3))


def test_not_allocated() -> None:
    msg = (
        "Cannot stage into EncodeOnceKV `text_kv`: it is not allocated; call "
        "`.allocate(num_layers=...)` first."
    )
    with pytest.raises(NotAllocatedError, match=_exact(msg)):
        EncodeOnceKV(name="text_kv").stage({"cond": {0: _pair()}})
    with pytest.raises(NotAllocatedError, match=_exact(msg.replace("stage into", "view"))):
        _kv().evict().view()


def test_constructed_unallocated_with_kv() -> None:
    msg = (
        "EncodeOnceKV `kv` holds K/V but is not allocated; build it with "
        "`.allocate(num_layers=...)`, `.stage(...)` and `.commit()`."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        EncodeOnceKV(layers=((_pair(),),))


def test_constructed_with_wrong_rows() -> None:
    msg = (
        "EncodeOnceKV `kv` `layers` must be 2 rows (one per branch) of 2 entries; build it "
        "with `.stage(...)` and `.commit()`."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        EncodeOnceKV(layers=((None,),), staged=(), num_layers=2, allocated=True)


def test_constructed_partially_initialised() -> None:
    msg = (
        "EncodeOnceKV `kv` holds partially initialised: branch `cond` is missing layer(s) 1 "
        "of 2. Stage every layer before `commit()`, or `discard()` the staged pairs."
    )
    p = _pair()
    with pytest.raises(IncompleteStateError, match=_exact(msg)):
        EncodeOnceKV(
            layers=((p, None), (None, None)),
            staged=((None, None), (None, None)),
            num_layers=2,
            allocated=True,
        )


def test_commit_partial_names_missing_layers() -> None:
    msg = (
        "EncodeOnceKV `text_kv` would be partially initialised: branch `uncond` is missing "
        "layer(s) 0, 2-4 of 5. Stage every layer before `commit()`, or `discard()` the staged "
        "pairs."
    )
    kv = _kv(5).stage({"uncond": {1: _pair()}})
    with pytest.raises(IncompleteStateError, match=_exact(msg)):
        kv.commit()
    assert kv.has_staged


def test_commit_nothing_staged() -> None:
    msg = (
        "EncodeOnceKV `text_kv` has nothing staged to commit; `stage(payload)` first, or pass "
        "the payload: `commit(payload)`."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _kv().commit()


def test_view_empty_and_partial() -> None:
    empty = (
        "EncodeOnceKV `text_kv` is empty: branch `cond` has no committed K/V for layer(s) 0-2 "
        "of 3. Encode the conditioning and `commit()` every layer before reading it."
    )
    with pytest.raises(IncompleteStateError, match=_exact(empty)):
        _kv().view("cond")
    partial = (
        "EncodeOnceKV `text_kv` is partially initialised: branch `cond` has no committed or "
        "staged K/V for layer(s) 0, 2 of 3. Encode the conditioning and `commit()` every layer "
        "before reading it."
    )
    with pytest.raises(IncompleteStateError, match=_exact(partial)):
        _kv().stage({"cond": {1: _pair()}}).view("cond", include_staged=True)


def test_layer_missing() -> None:
    msg = (
        "EncodeOnceKV `text_kv` has no committed K/V for layer 1 of branch `cond`; encode the "
        "conditioning and `stage(...)`/`commit()` it first."
    )
    with pytest.raises(IncompleteStateError, match=_exact(msg)):
        _kv().stage({"cond": {1: _pair()}}).layer("cond", 1)


def test_unknown_branch() -> None:
    msg = "EncodeOnceKV `text_kv` has no branch 'neg' (str); its branches are ['cond', 'uncond']."
    with pytest.raises(KeyError, match=_exact(msg)):
        _kv().layer("neg", 0)


def test_layer_out_of_range() -> None:
    msg = "EncodeOnceKV `text_kv` has layers 0-2, got layer 3 (int)."
    with pytest.raises(IndexError, match=_exact(msg)):
        _kv().stage({"cond": {3: _pair()}})


def test_sequence_of_wrong_length() -> None:
    msg = (
        "EncodeOnceKV `text_kv` branch `cond` got 1 pairs in a sequence, which must hold all 3 "
        "layers; pass a mapping `{layer: (k, v)}` to stage some of them."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _kv().stage({"cond": [_pair()]})


def test_branch_entries_of_wrong_type() -> None:
    msg = (
        "EncodeOnceKV `text_kv` branch `cond` takes a sequence of every layer's pair or a "
        "mapping of layer to pair, got KVPair."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        _kv().stage({"cond": _pair()})


def test_payload_not_a_mapping() -> None:
    msg = (
        "EncodeOnceKV `text_kv` stages a mapping of branch to pairs, got list; e.g. "
        "`{'cond': {0: (k, v)}}`."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        _kv().stage([_pair()])  # type: ignore[arg-type]


def test_pair_of_wrong_type() -> None:
    msg = (
        "EncodeOnceKV `text_kv` layer 0 of branch `cond` must be a KVPair or a (key, value) "
        "tuple, got Tensor."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        _kv().stage({"cond": {0: torch.zeros(1)}})


def test_allocate_arguments() -> None:
    layers = "`num_layers` must be a positive int (the transformer's layer count), got 0 (int)."
    with pytest.raises(ValueError, match=_exact(layers)):
        EncodeOnceKV().allocate(num_layers=0)
    branches = (
        "`branches` must be a non-empty tuple of distinct names, got ('a', 'a') (tuple); e.g. "
        "`branches=('cond', 'uncond')` for classifier-free guidance."
    )
    with pytest.raises(ValueError, match=_exact(branches)):
        EncodeOnceKV().allocate(num_layers=1, branches=("a", "a"))


def test_cosmos3_config_messages() -> None:
    with pytest.raises(KeyError, match=_exact("Unknown Cosmos3 preset 'big'; choose one of")):
        Cosmos3Config.preset("big")
    with pytest.raises(KeyError, match=_exact("Unknown Cosmos3 model setting 'layers' (value 3)")):
        Cosmos3Config.from_dict({"preset": "tiny", "layers": 3})
    heads = (
        "`num_heads` (3) must be a multiple of `num_kv_heads` (2): each K/V head serves a "
        "group of query heads."
    )
    with pytest.raises(ValueError, match=_exact(heads)):
        Cosmos3Config.preset("tiny", num_heads=3, num_kv_heads=2)
    patch = "`patch` (3) must divide the latent size 4x4."
    with pytest.raises(ValueError, match=_exact(patch)):
        Cosmos3Config.preset("tiny", patch=3)
    with pytest.raises(
        ValueError, match=_exact("`num_layers` must be a positive int, got 0 (int).")
    ):
        Cosmos3Config.preset("tiny", num_layers=0)
    with pytest.raises(TypeError, match=_exact("`seed` must be an int, got 1.5 (float).")):
        Cosmos3Config.preset("tiny", seed=1.5)
    with pytest.raises(
        TypeError, match=_exact("`guidance_scale` must be a number, got 'x' (str).")
    ):
        Cosmos3Config.preset("tiny", guidance_scale="x")
    with pytest.raises(ValueError, match=_exact("`dtype` must be one of")):
        Cosmos3Config.preset("tiny", dtype="int8")


def test_cosmos3_pipeline_messages() -> None:
    cap = (
        "`max_bespoke_sessions` must be a positive int, got 0; the bespoke path's cap is 64 "
        "upstream."
    )
    with pytest.raises(ValueError, match=_exact(cap)):
        Cosmos3Pipeline(Cosmos3Config.preset("tiny"), max_bespoke_sessions=0)
    pipe = Cosmos3Pipeline(
        Cosmos3Config.preset("tiny"), environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
    )
    unknown = (
        "Cosmos3 session 'x' is not held (never started, dropped or evicted); call "
        "`forward(request, session_id)` to start it."
    )
    with pytest.raises(KeyError, match=_exact(unknown)):
        pipe.session_values("x")


def test_unknown_model() -> None:
    msg = "Unknown model 'sora'; choose one of ['cosmos3', 'dreamzero']."
    with pytest.raises(KeyError, match=_exact(msg)):
        get_model("sora")
