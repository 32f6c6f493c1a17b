"""One contract on both paths, no raw torch errors, deeply immutable attributes.

Each test pins one behaviour: session ids follow one rule on both DreamZero paths and in the
manager; tensors the accounting cannot count are refused with their key path (and records
holding them never reach the manager); `LatentBuffer`, `SessionStateManager`,
`DreamZeroConfig` and the deploy YAML loader check their inputs up front; attributes are
deeply immutable; `tree_equal` compares floats bitwise; `to_device` keeps aliasing. Every
message is pinned in full.
"""

from __future__ import annotations

import pickle
import re
import sys
import tomllib
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sessionstate as ss
from sessionstate import (
    ENV_ENABLE,
    ImmutabilityViolationError,
    LatentBuffer,
    OmniDiffusionConfig,
    SessionAttr,
    SessionState,
    SessionStateManager,
    StateObject,
    UnsupportedTensorError,
    tree_equal,
)
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode
from tests.support import ROOT, torch_threads

CFG = DreamZeroConfig.preset("tiny")


def _exact(message: str) -> str:
    return f"^{re.escape(message)}$"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    with torch_threads(1):
        yield


# --- session ids: one rule on both paths -----------------------------------------------------


def _unhashable(value: object) -> str:
    return (
        "`session_id` must be hashable (any value a dict accepts as a key: a str, an int, a "
        f"tuple, ...), got {value!r} ({type(value).__name__}); pass an immutable id such as a "
        "str or a tuple."
    )


@pytest.mark.parametrize("managed", [False, True], ids=["bespoke", "managed"])
def test_both_paths_accept_any_hashable_session_id(managed: bool) -> None:
    pipe = DreamZeroPipeline(CFG, environ={ENV_ENABLE: "1" if managed else "0"})
    assert pipe.managed is managed
    (_, obs), *_ = scripted_episode(CFG, steps=1, sessions=1, seed=0)
    ids: list[Hashable] = [42, 0, "", ("user", 7)]  # None is refused: test_session_ids.py
    for sid in ids:
        pipe.forward(obs, sid)
    assert pipe.session_ids() == ids
    assert pipe.session_values(42)["call_count"] == 1
    assert pipe.drop_session(("user", 7))
    stats = pipe.stats()
    assert stats["sessions"] == 3
    assert all(isinstance(key, str) for key in stats)


@pytest.mark.parametrize("managed", [False, True], ids=["bespoke", "managed"])
@pytest.mark.parametrize("bad", [[7], {"a": 1}, ("ok", [1])], ids=repr)
def test_both_paths_refuse_an_unhashable_session_id_with_one_message(
    managed: bool, bad: object
) -> None:
    pipe = DreamZeroPipeline(CFG, environ={ENV_ENABLE: "1" if managed else "0"})
    (_, obs), *_ = scripted_episode(CFG, steps=1, sessions=1, seed=0)
    before = pipe.stats()
    for call in (
        lambda: pipe.forward(obs, bad),  # type: ignore[arg-type]
        lambda: pipe.drop_session(bad),  # type: ignore[arg-type]
        lambda: pipe.session_values(bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match=_exact(_unhashable(bad))):
            call()
    assert pipe.stats() == before


def test_manager_accepts_any_hashable_session_id() -> None:
    manager = SessionStateManager(8)
    ids: list[Hashable] = [1, 0, "", (1, "a"), 2.5, frozenset({1})]  # None: test_session_ids.py
    for sid in ids:
        manager.put(sid, SessionState(attrs={"x": torch.zeros(1)}))
        assert manager.require(sid) is manager.get(sid)
    assert manager.session_ids() == ids
    assert manager.stats()["nbytes:cpu"] == 4 * len(ids)
    assert manager.drop(0)
    assert None not in manager


# --- accounting: refused tensors, with key paths, before anything is stored -------------------


class _Wrapper(torch.Tensor):
    """A wrapper subclass that does not define `__tensor_flatten__`."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)  # type: ignore[attr-defined,no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError


def _torch_error(f: Any) -> str:
    try:
        f()
    except Exception as exc:
        return str(exc)
    raise AssertionError("expected torch to raise")


def test_wrapper_subclass_without_flatten_is_refused_with_its_key_path() -> None:
    w = _Wrapper(torch.zeros(3))
    reason = _torch_error(lambda: w.untyped_storage().data_ptr())
    msg = (
        "Cannot count the bytes of the tensor at `attrs['w']`, of type `_Wrapper` "
        f"(layout=torch.strided, device=cpu): it has no storage torch can report ({reason}). "
        "Store plain dense tensors, sparse tensors, or traceable wrapper subclasses (those "
        "defining `__tensor_flatten__`)."
    )
    with pytest.raises(UnsupportedTensorError, match=_exact(msg)):
        ss.nbytes_by_device(SessionState(attrs={"w": w}))


def test_uninitialized_parameter_is_refused() -> None:
    msg = (
        "Cannot count the bytes of the tensor at `['p']`, of type `UninitializedParameter`: an "
        "uninitialized (lazy) parameter or buffer has no storage yet. Run the lazy module once "
        "to materialize it, then store the materialized tensor."
    )
    with pytest.raises(UnsupportedTensorError, match=_exact(msg)):
        ss.nbytes_by_device({"p": torch.nn.UninitializedParameter()})


def test_vmap_batched_tensor_is_refused() -> None:
    msg = (
        "Cannot count the bytes of the tensor, of type `Tensor`: it is a `torch.vmap` batched "
        "tensor, which exists only inside the vmapped function and has no storage of its own. "
        "Count the unbatched tensor outside `torch.vmap`."
    )
    seen: list[str] = []

    def count(x: torch.Tensor) -> torch.Tensor:
        with pytest.raises(UnsupportedTensorError, match=_exact(msg)):
            ss.nbytes_by_device(x)
        seen.append("raised")
        return x

    torch.vmap(count)(torch.zeros(2, 3))
    assert seen == ["raised"]


def test_fake_tensor_is_refused_not_counted_as_host_bytes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(100)
    msg = (
        "Cannot count the bytes of the tensor at `['f']`, of type `FakeTensor` (device=cpu): a "
        "fake tensor describes a tensor without holding its memory, so counting it as real "
        "bytes would be wrong. Build the tree on the `meta` device to size it without "
        "allocating."
    )
    with pytest.raises(UnsupportedTensorError, match=_exact(msg)):
        ss.nbytes_by_device({"f": fake})


def test_per_channel_quantized_tensor_counts_its_scales_and_zero_points() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(
            torch.randn(4, 3), torch.ones(4), torch.zeros(4, dtype=torch.long), 0, torch.qint8
        )
    data = q.untyped_storage().nbytes()
    scales = q.q_per_channel_scales().untyped_storage().nbytes()
    zeros = q.q_per_channel_zero_points().untyped_storage().nbytes()
    assert ss.nbytes_by_device({"q": q, "again": q}) == {"cpu": data + scales + zeros}


class _Plain(torch.Tensor):
    """A non-wrapper subclass whose `__tensor_flatten__` names no inner tensors."""

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return [], None

    @staticmethod
    def __tensor_unflatten__(inner: Any, meta: Any, size: Any, stride: Any) -> None:
        return None


def test_subclass_naming_no_inner_tensors_counts_its_own_storage() -> None:
    t = torch.zeros(10).as_subclass(_Plain)
    assert ss.nbytes_by_device([t, t[2:]]) == {"cpu": 40}


@pytest.mark.parametrize("how", ["put", "get_or_create"])
def test_manager_refuses_an_uncountable_record_up_front(how: str) -> None:
    manager = SessionStateManager(2)
    resident = SessionState(attrs={"x": torch.zeros(4)})
    manager.put("a", resident)
    bad = SessionState(attrs={"p": torch.nn.UninitializedParameter()})
    before = manager.stats()

    def store() -> None:
        if how == "put":
            manager.put("a", bad)
        else:
            manager.get_or_create("b", lambda: bad)

    with pytest.raises(UnsupportedTensorError, match=re.escape("at `attrs['p']`")):
        store()
    assert manager.get("a") is resident
    assert "b" not in manager
    after = manager.stats()
    assert after["nbytes:cpu"] == before["nbytes:cpu"] == 16
    assert manager.nbytes_by_session() == {"a": {"cpu": 16}}


# --- SessionState.nbytes_by_value lists subclass fields ---------------------------------------


@ss.record
class _WithField(SessionState):
    extra: torch.Tensor = ss.field(factory=lambda: torch.zeros(100))


def test_nbytes_by_value_lists_fields_a_subclass_adds() -> None:
    s = _WithField(attrs={"a": torch.zeros(10)})
    by_value = s.nbytes_by_value()
    assert by_value == {"a": {"cpu": 40}, "extra": {"cpu": 400}}
    assert sum(v.get("cpu", 0) for v in by_value.values()) == s.nbytes_by_device()["cpu"]


# --- LatentBuffer input checks -----------------------------------------------------------------


def test_commit_refuses_a_chunk_of_another_layout() -> None:
    ring = LatentBuffer(name="r", dim=0).allocate(maxlen=3).commit(torch.zeros(1, 2))
    msg = (
        "LatentBuffer `r` holds chunks of layout torch.strided; got layout torch.sparse_coo, "
        "which `torch.cat` cannot join with them. Convert the chunk (`.to_dense()`, "
        "`.to_sparse()`) or `reset()` the buffer to change its layout."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ring.commit(torch.zeros(1, 2).to_sparse())
    assert len(ring) == 1


def test_concat_last_zero_says_it_selects_nothing() -> None:
    buf = LatentBuffer(name="b", dim=0).allocate().commit(torch.zeros(1)).commit(torch.ones(2))
    msg = (
        "`last=0` selects no chunks of LatentBuffer `b` (it holds 2), and there is nothing to "
        "join; pass `last` >= 1, or `last=None` for every chunk."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        buf.concat(last=0)


def test_constructor_refuses_a_tensor_as_chunks() -> None:
    msg = (
        "LatentBuffer `chunks` must be a sequence of tensors, got one tensor of shape (3, 2); "
        "pass `chunks=(t,)`, or build the buffer with `.allocate(...)` and `.commit(t)`."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        LatentBuffer(torch.zeros(3, 2), dim=0, allocated=True)


def test_constructor_checks_chunks_as_commit_does() -> None:
    msg = "LatentBuffer `b` holds tensors, got int; commit a torch.Tensor."
    with pytest.raises(TypeError, match=_exact(msg)):
        LatentBuffer((1, 2), name="b", dim=0, allocated=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("got dtype torch.float64")):
        LatentBuffer(
            (torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.float64)), dim=0, allocated=True
        )


# --- manager and factory arguments ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["no", 1, None], ids=repr)
def test_check_immutable_accepts_a_bool_only(value: object) -> None:
    msg = (
        f"`check_immutable` must be a bool (True or False), got {value!r} ({type(value).__name__})."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionStateManager(check_immutable=value)  # type: ignore[arg-type]


def test_get_or_create_checks_the_factory_first() -> None:
    manager = SessionStateManager()
    msg = (
        "Session 'a': `factory` must be a callable that returns a new SessionState, got 5 "
        "(int); pass the class itself (e.g. `SessionState`) or a function."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        manager.get_or_create("a", 5)  # type: ignore[arg-type]
    assert manager.stats()["misses"] == 0
    assert len(manager) == 0


# --- DreamZeroConfig relations --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "msg"),
    [
        (
            {"num_frames": 1},
            "`num_frame_per_block` (2) cannot exceed the latent frames of a `num_frames` clip "
            "(1 frames -> 1 latent frames); use `num_frame_per_block` <= 1, or `num_frames` >= 5.",
        ),
        (
            {"num_frame_per_block": 5},
            "`num_frame_per_block` (5) cannot exceed the latent frames of a `num_frames` clip "
            "(9 frames -> 3 latent frames); use `num_frame_per_block` <= 3, or `num_frames` >= 17.",
        ),
        (
            {"vae_z_dim": 3},
            "`vae_z_dim` must be at least 4 (the conditioning mask has 4 channels), got 3; use 4 "
            "or more (16 at deploy).",
        ),
        (
            {"num_frames": 6},
            "`num_frames` must be 1 more than a multiple of 4 (the Wan VAE encodes one frame, "
            "then 4 at a time), got 6; use 5 or 9.",
        ),
    ],
)
def test_dreamzero_config_refuses_geometries_that_cannot_run(
    overrides: dict[str, int], msg: str
) -> None:
    with pytest.raises(ValueError, match=_exact(msg)):
        DreamZeroConfig.preset("tiny", **overrides)


def test_dreamzero_config_accepts_the_boundary_geometries() -> None:
    for overrides in ({"num_frames": 1, "num_frame_per_block": 1}, {"vae_z_dim": 4}):
        cfg = DreamZeroConfig.preset("tiny", **overrides)
        pipe = DreamZeroPipeline(cfg, environ={ENV_ENABLE: "1"})
        for sid, obs in scripted_episode(cfg, steps=3, sessions=1, seed=0):
            pipe.forward(obs, sid)


# --- deploy YAML -------------------------------------------------------------------------------


def test_yaml_duplicate_key_names_the_key_and_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "enable_session_state_manager: true\nmodel: {preset: tiny}\n"
        "enable_session_state_manager: false\n",
        encoding="utf-8",
    )
    msg = (
        f"Deploy config {str(path)!r}: key 'enable_session_state_manager' appears twice in one "
        "mapping (lines 1 and 3); keep one."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        OmniDiffusionConfig.from_yaml(path)


def test_yaml_duplicate_key_inside_the_model_section(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("model:\n  preset: tiny\n  seed: 1\n  seed: 2\n", encoding="utf-8")
    msg = (
        f"Deploy config {str(path)!r}: key 'seed' appears twice in one mapping (lines 3 and 4); "
        "keep one."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        OmniDiffusionConfig.from_yaml(path)


def test_yaml_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    raw = "model: {preset: tïny}\n".encode("latin-1")
    path.write_bytes(raw)
    reason = _torch_error(lambda: raw.decode("utf-8"))
    msg = f"Deploy config {str(path)!r}: the file is not UTF-8 text ({reason}); save it as UTF-8."
    with pytest.raises(ValueError, match=_exact(msg)):
        OmniDiffusionConfig.from_yaml(path)


def test_yaml_model_section_error_names_the_file_and_the_closest_key(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("model: {preset: tiny, num_frame: 9}\n", encoding="utf-8")
    config = OmniDiffusionConfig.from_yaml(path)
    known = sorted(a.name for a in attrs.fields(DreamZeroConfig) if a.name != "name")
    msg = (
        f"Deploy config {str(path)!r}, `model` section: Unknown DreamZero model setting "
        f"'num_frame' (value 9); did you mean 'num_frames'? Known: {['preset', *known]}."
    )
    with pytest.raises(KeyError, match=_exact(msg)):
        DreamZeroPipeline(config, environ={})


# --- supported Python ----------------------------------------------------------------------------


def test_the_claimed_python_versions_are_the_ones_the_package_supports() -> None:
    # `import sessionstate` needs `typing.dataclass_transform` (3.11+); every claim says so.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["requires-python"] == ">=3.11"
    assert pyproject["tool"]["ruff"]["target-version"] == "py311"
    for doc in ("README.md", "docs/index.md"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        assert "Python 3.11+" in text
        assert "3.10" not in text
    assert sys.version_info >= (3, 11)


# --- deep immutability ---------------------------------------------------------------------------

_scalars = st.one_of(st.integers(), st.text(max_size=3), st.none(), st.booleans())
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
    ),
    max_leaves=12,
)

_MUTATIONS = (
    lambda c: c.append(1),
    lambda c: c.__setitem__(0, 1),
    lambda c: c.__setitem__("k", 1),
    lambda c: c.clear(),
    lambda c: c.pop(),
    lambda c: c.update({"k": 1}),
    lambda c: c.add(1),
    lambda c: c.extend([1]),
    lambda c: c.__delitem__(0),
)


def _containers(value: object) -> list[object]:
    out = [value]
    if isinstance(value, (tuple, list)):
        for v in value:
            out += _containers(v)
    elif isinstance(value, (dict, ss.SessionState)) or hasattr(value, "keys"):
        for v in value.values():  # type: ignore[attr-defined]
            out += _containers(v)
    return out


def _plain(value: object) -> object:
    # The value as plain data, for comparing versions (tuples and lists alike).
    if isinstance(value, (tuple, list)):
        return ("seq", [_plain(v) for v in value])
    if hasattr(value, "keys"):
        return ("map", sorted((repr(k), _plain(v)) for k, v in value.items()))  # type: ignore[attr-defined]
    return value


@given(values=st.lists(_values, min_size=1, max_size=4))
def test_no_reachable_container_of_any_version_can_be_mutated(values: list[object]) -> None:
    state = SessionState()
    versions = []
    for i, value in enumerate(values):
        state = state.with_attrs(**{f"v{i % 2}": value})
        versions.append((state, {k: _plain(v) for k, v in state.attrs.items()}))
    for state, _ in versions:
        for name in state.attrs:
            for container in _containers(state.get_attr(name)) + _containers(state.attrs[name]):
                for mutate in _MUTATIONS:
                    try:
                        mutate(container)
                    except (AttributeError, TypeError):
                        continue
                    raise AssertionError(f"mutated {container!r} through `{name}`")
    for state, expected in versions:
        assert {k: _plain(v) for k, v in state.attrs.items()} == expected


def test_lists_and_dicts_become_tuples_and_read_only_mappings() -> None:
    source = {"ids": [1, 2], "nested": {"x": [3]}}
    s = SessionState(attrs={"cfg": source}).with_attrs(seq=[[1], (2, [3])])
    source["ids"].append(99)  # the caller's own object stays the caller's
    assert s.attrs["cfg"] == {"ids": (1, 2), "nested": {"x": (3,)}}
    assert s.attrs["seq"] == ((1,), (2, (3,)))
    assert tree_equal(s, pickle.loads(pickle.dumps(s)))
    t = torch.zeros(4)
    holder = SessionState(attrs={"d": {"t": t}})
    assert ss.nbytes_by_device(holder) == {"cpu": 16}
    assert ss.tree_flatten_with_keys(holder)[0] == ["attrs['d']['t']"]


def test_a_frozen_mapping_refuses_assignment() -> None:
    frozen = SessionState(attrs={"cfg": {"a": 1}}).attrs["cfg"]
    msg = "`FrozenDict` is immutable; build a new one: `FrozenDict({**d, key: value})`."
    with pytest.raises(AttributeError, match=_exact(msg)):
        frozen._data = {}


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ({1, 2}, "a frozenset (`frozenset(value)`)"),
        (bytearray(b"ab"), "bytes (`bytes(value)`)"),
    ],
    ids=["set", "bytearray"],
)
def test_mutable_containers_that_cannot_be_converted_are_refused(value: object, fix: str) -> None:
    msg = (
        f"Session attribute value `cfg['k'][0]` is a mutable {type(value).__name__}: "
        f"{value!r}. Session state is immutable all the way down; store {fix} instead."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionState().with_attrs(cfg={"k": [value]})
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionState(attrs={"cfg": {"k": [value]}})


# --- StateObjects must be records -------------------------------------------------------------


class _NotARecord(StateObject):
    is_allocated = True

    def allocate(self, **sizing: Any) -> _NotARecord:
        return self

    def commit(self, payload: Any, /) -> _NotARecord:
        return self

    def view(self) -> Any:
        return None

    def reset(self) -> _NotARecord:
        return self

    def evict(self) -> _NotARecord:
        return self


def test_a_state_object_that_is_not_a_record_is_refused() -> None:
    msg = (
        "State object `cache` is a `_NotARecord`, a StateObject that is not a record, so its "
        "tensors would be invisible to byte accounting, the immutability guard and `tree_map`. "
        "Decorate `_NotARecord` with `@sessionstate.record`."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionState(objects={"cache": _NotARecord()})
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionState().with_object("cache", _NotARecord())


# --- guard gaps ---------------------------------------------------------------------------------


def _corrupted() -> tuple[SessionStateManager, torch.Tensor]:
    manager = SessionStateManager(check_immutable=True)
    t = torch.zeros(4)
    manager.put("s", SessionState(attrs={"x": t}))
    t.add_(1)
    return manager, t


def test_peek_reports_a_corrupted_record() -> None:
    manager, _ = _corrupted()
    with pytest.raises(ImmutabilityViolationError, match=re.escape("Session 's': the tensor at")):
        manager.peek("s")
    assert manager.stats()["hits"] == 0


def test_put_replaces_a_corrupted_record() -> None:
    manager, _ = _corrupted()
    fresh = SessionState(attrs={"x": torch.ones(4)})
    manager.put("s", fresh)
    assert manager.get("s") is fresh
    assert manager.peek("s") is fresh


def test_guard_blind_spot_untyped_storage_write() -> None:
    # Documented blind spot: a write through the untyped storage bypasses the version counter.
    manager = SessionStateManager(check_immutable=True)
    t = torch.zeros(4)
    manager.put("s", SessionState(attrs={"x": t}))
    t.untyped_storage().fill_(1)
    assert manager.get("s") is not None
    assert t.sum().item() != 0


# --- tree_equal on Python floats ------------------------------------------------------------------


def test_tree_equal_treats_float_leaves_bitwise_like_tensors() -> None:
    nan = float("nan")
    assert tree_equal({"a": nan}, {"a": float("nan")})
    assert not tree_equal({"a": 0.0}, {"a": -0.0})
    assert tree_equal({"c": complex(nan, 1)}, {"c": complex(nan, 1)})
    s = SessionState(attrs={"loss": nan, "x": torch.tensor([nan])})
    assert tree_equal(s, pickle.loads(pickle.dumps(s)))


# --- to_device ------------------------------------------------------------------------------------


def test_to_device_moves_every_tensor_once_and_keeps_aliasing() -> None:
    base = torch.arange(16.0)
    ring = LatentBuffer(name="r", dim=0).allocate(maxlen=2).commit(base[:4]).commit(base[4:8])
    attributes = {"full": base, "tail": base[8:].view(2, 4), "n": 3}
    state = SessionState(objects={"r": ring}, attrs=attributes)
    moved = ss.to_device(state, "meta")
    assert moved.attrs["n"] == 3
    assert ss.nbytes_by_device(moved) == {"meta": 64} == {"meta": ss.nbytes_by_device(state)["cpu"]}
    leaves = [t for t in ss.tree_leaves(moved) if isinstance(t, torch.Tensor)]
    assert {t.untyped_storage()._cdata for t in leaves} == {leaves[0].untyped_storage()._cdata}
    assert moved.attrs["tail"].shape == (2, 4)
    assert moved.attrs["tail"].storage_offset() == 8
    same = ss.to_device(state, "cpu")
    assert same.attrs["full"] is base
    assert tree_equal(same, state)


# --- messages -----------------------------------------------------------------------------------


def test_assigning_a_state_object_suggests_with_object() -> None:
    s = SessionState(objects={"latents": LatentBuffer()})
    msg = (
        "`SessionState` is immutable; `obj.latents = ...` cannot assign. Use "
        "`state = state.with_object('latents', obj)` or "
        "`state = state.update_object('latents', fn)`, which returns a new record."
    )
    with pytest.raises(AttributeError, match=_exact(msg)):
        s.latents = None  # type: ignore[attr-defined]


class _Counter(SessionState):
    steps = SessionAttr(0, coerce=int, doc="Completed steps.")


def test_a_refused_coercion_names_the_attribute_the_value_and_the_coercion() -> None:
    reason = _torch_error(lambda: int("abc"))
    msg = (
        "Session attribute `steps` coerces its values with `int`, which refused 'abc' (str): "
        f"ValueError: {reason}. Pass a value `int` accepts."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        _Counter().with_attrs(steps="abc")
