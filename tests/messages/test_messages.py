"""Every user-facing message of the core library, pinned word for word.

One test per message. A change of wording should be a deliberate edit here too: these
sentences are what a user reads when something goes wrong, and they name the fix.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
import yaml

import sessionstate as ss
from sessionstate import (
    LatentBuffer,
    OmniDiffusionConfig,
    SessionAttr,
    SessionState,
    SessionStateManager,
)


def _exact(message: str) -> str:
    return re.escape(message)


# --- _tree ----------------------------------------------------------------------------------


@ss.record
class Box:
    value: object


def test_assignment_to_a_record() -> None:
    msg = (
        "`Box` is immutable; `obj.value = ...` cannot assign. "
        "Use `obj = attrs.evolve(obj, value=...)`, which returns a new record."
    )
    with pytest.raises(ss.ImmutableRecordError, match=_exact(msg)) as info:
        Box(1).value = 2  # type: ignore[misc]
    assert str(info.value) == msg


def test_assignment_to_a_session() -> None:
    msg = (
        "`SessionState` is immutable; `obj.step = ...` cannot assign. "
        "Use `state = state.with_attrs(step=...)`, which returns a new record."
    )
    with pytest.raises(ss.ImmutableRecordError, match=_exact(msg)) as info:
        SessionState().step = 1  # type: ignore[attr-defined]
    assert str(info.value) == msg


def test_deletion_from_a_record() -> None:
    msg = (
        "`Box` is immutable; `del obj.value` cannot delete. "
        "Use `obj = attrs.evolve(obj, value=...)`, which returns a new record."
    )
    with pytest.raises(ss.ImmutableRecordError, match=_exact(msg)):
        del Box(1).value


def test_assignment_to_session_objects() -> None:
    msg = (
        "`SessionState` is immutable; `obj.objects = ...` cannot assign. "
        "Use `state = state.with_object(name, obj)`, which returns a new record."
    )
    with pytest.raises(ss.ImmutableRecordError, match=_exact(msg)):
        SessionState().objects = {}  # type: ignore[misc]


def test_assignment_of_an_undeclared_attr_on_a_declaring_session() -> None:
    class Declaring(SessionState):
        step = SessionAttr(0)

    msg = (
        "`Declaring` is immutable; `obj.typo = ...` cannot assign. "
        "Use `state = state.with_attrs(...) with one of ['step']`, which returns a new record."
    )
    with pytest.raises(ss.ImmutableRecordError, match=_exact(msg)):
        Declaring().typo = 1  # type: ignore[attr-defined]


def test_session_attr_shadowing_a_member() -> None:
    msg = (
        "`Shadowing.objects` would shadow `SessionState.objects`; give the session attribute "
        "another name."
    )
    with pytest.raises(TypeError, match=_exact(msg)):

        class Shadowing(SessionState):
            objects = SessionAttr(None)  # type: ignore[assignment]


def test_negative_dim() -> None:
    msg = (
        "`dim` must be a non-negative int (the chunks' time dimension), got -1 (int); count it "
        "from the front, e.g. `dim=2` for (B, C, T, H, W)."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        LatentBuffer(dim=-1)


# --- _accounting ----------------------------------------------------------------------------


def test_strided_nested_tensor() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    msg = (
        "Cannot count the bytes of the tensor at `[0]`, of type `Tensor`: a strided nested "
        "tensor (layout=torch.strided) keeps its storage private to torch. Store the component "
        "tensors (`t.unbind()`) or a jagged nested tensor (`layout=torch.jagged`) instead."
    )
    with pytest.raises(ss.UnsupportedTensorError, match=_exact(msg)) as info:
        ss.nbytes_by_device([nested])
    assert str(info.value) == msg


def test_tensor_without_storage() -> None:
    opaque = torch.zeros(3).to_mkldnn()
    with pytest.raises(RuntimeError) as torch_error:
        opaque.untyped_storage()
    msg = (
        "Cannot count the bytes of the tensor at `['x']`, of type `Tensor` "
        "(layout=torch._mkldnn, device=cpu): it has no storage torch can report "
        f"({torch_error.value}). Store plain dense tensors, sparse tensors, or traceable "
        "wrapper subclasses (those defining `__tensor_flatten__`)."
    )
    with pytest.raises(ss.UnsupportedTensorError, match=_exact(msg)) as info:
        ss.nbytes_by_device({"x": opaque})
    assert str(info.value) == msg


# --- _objects -------------------------------------------------------------------------------


def test_invalid_maxlen() -> None:
    msg = (
        "`maxlen` must be a positive int or None, got 0 (int). "
        "Use `maxlen=None` to keep every chunk, or `maxlen=k` for a ring of the last k."
    )
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        LatentBuffer().allocate(maxlen=0)
    assert str(info.value) == msg


def test_invalid_last() -> None:
    msg = (
        "`last` must be a non-negative int or None, got -1 (int); pass `last=None` for every "
        "retained chunk."
    )
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        LatentBuffer().allocate().view(last=-1)
    assert str(info.value) == msg


def test_last_beyond_the_ring() -> None:
    ring = LatentBuffer(name="vae_encoder_out").allocate(maxlen=2)
    msg = (
        "Requested 3 chunks but the ring `vae_encoder_out` retains at most 2; "
        "ask for at most 2, or allocate a larger ring."
    )
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        ring.view(last=3)
    assert str(info.value) == msg


def test_concat_of_nothing() -> None:
    msg = "LatentBuffer `frames` is empty; check `len(buffer)` before `concat()`."
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        LatentBuffer(name="frames").allocate().concat()
    assert str(info.value) == msg


@pytest.mark.parametrize(
    ("action", "use"),
    [
        ("commit to", lambda b: b.commit(torch.zeros(1, 1, 1))),
        ("view", lambda b: b.view()),
        ("reset", lambda b: b.reset()),
    ],
)
def test_not_allocated(action: str, use: object) -> None:
    msg = (
        f"Cannot {action} LatentBuffer `vae_encoder_out`: it is not allocated; "
        "call `.allocate(maxlen=...)` first."
    )
    with pytest.raises(ss.NotAllocatedError, match=_exact(msg)) as info:
        use(LatentBuffer(name="vae_encoder_out"))  # type: ignore[operator]
    assert str(info.value) == msg


def test_chunk_not_a_tensor() -> None:
    msg = "LatentBuffer `frames` holds tensors, got list; commit a torch.Tensor."
    with pytest.raises(TypeError, match=_exact(msg)) as info:
        LatentBuffer(name="frames").allocate().commit([1.0])  # type: ignore[arg-type]
    assert str(info.value) == msg


def test_chunk_without_the_time_dim() -> None:
    msg = (
        "LatentBuffer `frames` concatenates along dim 2, so a chunk needs at least 3 dims; "
        "got shape (4, 4). Commit chunks with the time axis at `dim`, "
        "or build the buffer with a matching `dim=`."
    )
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        LatentBuffer(name="frames").allocate().commit(torch.zeros(4, 4))
    assert str(info.value) == msg


def test_chunk_of_another_layout() -> None:
    buf = LatentBuffer(name="frames", dim=1).allocate().commit(torch.zeros(1, 3, 4))
    msg = (
        "LatentBuffer `frames` holds chunks of dtype torch.float32 on cpu with shape "
        "(1, T, 4); got dtype torch.float64 on cpu with shape (1, 2, 4). Convert the chunk "
        "(`.to(dtype=..., device=...)`) or `reset()` the buffer to change its layout."
    )
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        buf.commit(torch.zeros(1, 2, 4, dtype=torch.float64))
    assert str(info.value) == msg


# --- _session -------------------------------------------------------------------------------


class Counted(SessionState):
    steps = SessionAttr(0, coerce=int)
    language = SessionAttr(None)


def test_missing_state_object() -> None:
    state = SessionState(objects={"frames": LatentBuffer()})
    msg = (
        "Session has no state object `nope`; it has ['frames']. "
        "Add it with `state.with_object(name, obj)`."
    )
    with pytest.raises(KeyError, match=_exact(msg)) as info:
        state.object("nope")
    assert info.value.args == (msg,)


def test_with_object_of_a_non_state_object() -> None:
    msg = (
        "State object `emb` must be a StateObject (e.g. LatentBuffer), got Tensor; "
        "carried values go in `with_attrs(emb=...)`."
    )
    with pytest.raises(TypeError, match=_exact(msg)) as info:
        SessionState().with_object("emb", torch.zeros(1))  # type: ignore[arg-type]
    assert str(info.value) == msg


def test_undeclared_attribute() -> None:
    msg = (
        "`Counted` declares no attribute `stpes`; declared: ['language', 'steps']. "
        "Declare it with `stpes = SessionAttr(...)`."
    )
    with pytest.raises(AttributeError, match=_exact(msg)) as info:
        Counted().with_attrs(stpes=1)
    assert str(info.value) == msg


def test_unset_attribute() -> None:
    msg = "Session attribute `language` is not set; set it with `state.with_attrs(language=...)`."
    with pytest.raises(KeyError, match=_exact(msg)) as info:
        SessionState().get_attr("language")
    assert info.value.args == (msg,)


# --- _manager -------------------------------------------------------------------------------


def test_unhashable_session_id() -> None:
    msg = (
        "`session_id` must be hashable (any value a dict accepts as a key: a str, an int, a "
        "tuple, ...), got [7] (list); pass an immutable id such as a str or a tuple."
    )
    with pytest.raises(TypeError, match=_exact(msg)) as info:
        SessionStateManager().get([7])  # type: ignore[arg-type]
    assert str(info.value) == msg


def test_bad_max_sessions() -> None:
    msg = "`max_sessions` must be a positive int, got 0 (int); the default is 64."
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        SessionStateManager(0)
    assert str(info.value) == msg


def test_bad_on_full() -> None:
    # The one pin of the check every entry point shares (`check_choice`): the manager, the
    # deploy config (`session_state_on_full`), the testing machines.
    msg = (
        "`on_full` must be 'evict' or 'refuse', got 'drop' (str): 'evict' drops the least "
        "recently used session at the cap, 'refuse' refuses the new one."
    )
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        SessionStateManager(on_full="drop")  # type: ignore[arg-type]
    assert str(info.value) == msg


def test_lost_session() -> None:
    msg = (
        "Session 'cam-1' is not held by this manager (never created, dropped, or evicted by "
        "the LRU cap); its state is lost. Start it again with `get_or_create`, or raise the cap."
    )
    with pytest.raises(ss.SessionStateLostError, match=_exact(msg)) as info:
        SessionStateManager().require("cam-1")
    # Unlike a plain KeyError, the message prints unquoted.
    assert str(info.value) == msg


@pytest.mark.parametrize("blocks", [6, 7])
def test_a_step_out_of_blocks_of_a_pool_that_declares_no_step(blocks: int) -> None:
    # With a block to spare, "b" took it and "c" found none: one free once the step gave
    # "b"'s back, which the message says (it said "1 needed, 1 free").
    pool = ss.KVPool(blocks, block_tokens=2, token_shape=(2,), name="p2")
    m: ss.SessionStateManager[ss.SessionState] = ss.SessionStateManager(pools=(pool,))
    for sid in "abc":
        cache = ss.KVCache(name="kv").allocate().append(pool, torch.ones(4, 2))
        m.put(sid, ss.SessionState(objects={"kv": cache}))

    def grow(states: list[ss.SessionState]) -> tuple[list[ss.SessionState], list[int]]:
        grown = [
            s.with_object("kv", s.object("kv", ss.KVCache).append(pool, torch.ones(1, 2)))
            for s in states
        ]
        return grown, [0] * len(states)

    msg = (
        "Batch ['b', 'c']: KV pool 'p2' ran out of blocks during the step (an append needed 1 "
        f"free block and found fewer; {blocks - 6} free now that the step gave its blocks "
        "back). The pool declares no `step_tokens`, so the manager made no room before the "
        "step: it parks other sessions' KV only for a pool that says what a step takes. Step "
        "a smaller batch, or build the pool with `step_tokens` (and `window_tokens` for a "
        "windowed cache), or with more blocks."
    )
    with pytest.raises(ss.KVPoolExhaustedError, match=_exact(msg)):
        m.step_many(["b", "c"], grow, new=ss.SessionState)
    assert pool.free_blocks == blocks - 6  # the three sessions' blocks, the step's given back
    msg = (
        "Session 'a': KV pool 'p2' ran out of blocks during the step (an append needed 1 free "
        f"block and found fewer; {blocks - 6} free now that the step gave its blocks back). The "
        "pool declares no `step_tokens`, so the manager made no room before the step: it parks "
        "other sessions' KV only for a pool that says what a step takes. Build the pool with "
        "`step_tokens` (and `window_tokens` for a windowed cache), or with more blocks."
    )
    if blocks == 6:
        with pytest.raises(ss.KVPoolExhaustedError, match=_exact(msg)):
            m.step("a", lambda s: (grow([s])[0][0], 0), new=ss.SessionState)


def test_a_batch_over_the_budget_midway() -> None:
    m = SessionStateManager(max_bytes={"cpu": 800})
    m.put("r", SessionState(attrs={"x": torch.zeros(100)}))
    batch = [
        ("n", SessionState(attrs={"x": torch.zeros(125)})),
        ("r", SessionState(attrs={"x": torch.zeros(10)})),
    ]
    msg = (
        "Cannot store the batch ['n', 'r']: while 'n' is stored, the batch's new records up to "
        "it and the records the members after it still hold come to 900 bytes on cpu, more "
        "than the whole budget of 800 bytes there (`max_bytes`); storing it would evict or "
        "park every other session and still not fit. List the sessions it replaces first, "
        "store a smaller batch, or raise the budget for cpu."
    )
    with pytest.raises(ss.SessionAdmissionError, match=_exact(msg)):
        m.put_many(batch)


def test_refused_admission() -> None:
    manager = SessionStateManager(2, on_full="refuse")
    manager.put("a", SessionState())
    manager.put("b", SessionState())
    msg = (
        "Cannot admit session 'c': the manager holds 2 sessions (its cap) and "
        "`on_full='refuse'`. Drop a finished session first, or raise `max_sessions`."
    )
    with pytest.raises(ss.SessionAdmissionError, match=_exact(msg)) as info:
        manager.put("c", SessionState())
    assert str(info.value) == msg


def test_storing_a_non_session() -> None:
    msg = (
        "Session 'a': the manager stores SessionState records, got dict; "
        "build one with `SessionState(objects=..., attrs=...)`."
    )
    with pytest.raises(TypeError, match=_exact(msg)) as info:
        SessionStateManager().put("a", {})  # type: ignore[arg-type]
    assert str(info.value) == msg


# --- _config --------------------------------------------------------------------------------


def test_flag_not_a_bool() -> None:
    msg = "`enable_session_state_manager` must be a bool (true or false), got 'yes' (str)."
    with pytest.raises(TypeError, match=_exact(msg)) as info:
        OmniDiffusionConfig(enable_session_state_manager="yes")  # type: ignore[arg-type]
    assert str(info.value) == msg


def test_model_not_a_mapping() -> None:
    msg = "`model` must be a mapping of model settings, got ['tiny'] (list)."
    with pytest.raises(TypeError, match=_exact(msg)) as info:
        OmniDiffusionConfig(model=["tiny"])  # type: ignore[arg-type]
    assert str(info.value) == msg


def test_config_not_a_mapping() -> None:
    msg = "A deploy config must be a mapping of keys to values, got list."
    with pytest.raises(TypeError, match=_exact(msg)) as info:
        OmniDiffusionConfig.from_dict([])  # type: ignore[arg-type]
    assert str(info.value) == msg


def test_unknown_config_key() -> None:
    msg = (
        "Unknown deploy config key 'max_sessions' (value 8); "
        "known keys: ['enable_session_state_manager', 'model', 'session_state_host_pool_bytes', "
        "'session_state_host_pool_full', 'session_state_keep_parked_copies', "
        "'session_state_kv_pool_bytes', 'session_state_max_bytes', 'session_state_on_full', "
        "'session_state_park_tier', "
        "'session_state_spool_dir']."
    )
    with pytest.raises(KeyError, match=_exact(msg)) as info:
        OmniDiffusionConfig.from_dict({"max_sessions": 8})
    assert info.value.args == (msg,)


def test_invalid_yaml(tmp_path: Path) -> None:
    text = "enable_session_state_manager: [true\n"
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    with pytest.raises(yaml.YAMLError) as parser_error:
        yaml.safe_load(text)
    msg = f"Deploy config {str(path)!r} is not valid YAML: {parser_error.value}"
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        OmniDiffusionConfig.from_yaml(path)
    assert str(info.value) == msg


def _warning_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sessionstate"]


def test_unparsable_flag_warning(caplog: pytest.LogCaptureFixture) -> None:
    config = OmniDiffusionConfig(enable_session_state_manager=True)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        ss.resolve_session_state_config(config, {ss.ENV_ENABLE: "maybe"})
    assert _warning_messages(caplog) == [
        "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER='maybe': expected one of "
        "1/0/true/false/yes/no/on/off; using the config value enable_session_state_manager=True."
    ]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_unparsable_max_sessions_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        ss.resolve_session_state_config(None, {ss.ENV_MAX_SESSIONS: "0"})
    assert _warning_messages(caplog) == [
        "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS='0': expected a positive "
        "int; using the default cap 64."
    ]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_unparsable_check_immutable_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings = ss.resolve_session_state_config(None, {ss.ENV_CHECK_IMMUTABLE: "sure"})
    assert settings.check_immutable is False
    assert _warning_messages(caplog) == [
        "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER_CHECK_IMMUTABLE='sure': expected one of "
        "1/0/true/false/yes/no/on/off; the check stays off."
    ]


def test_in_place_write_into_a_stored_record() -> None:
    manager = SessionStateManager(check_immutable=True)
    chunk = torch.zeros(3)
    ring = LatentBuffer(name="ring", dim=0).allocate(maxlen=2).commit(torch.ones(1)).commit(chunk)
    manager.put("s1", SessionState(objects={"ring": ring}))
    chunk.add_(1)
    msg = (
        "Session 's1': the tensor at `objects['ring'].chunks[1]` was modified in place after the "
        "record was stored (version 0 -> 1). Records are immutable: build new tensors "
        "(`t = t + x`, not `t += x` or `t.copy_(...)`), then `drop('s1')` this corrupted session."
    )
    with pytest.raises(ss.ImmutabilityViolationError, match=_exact(msg)):
        manager.get("s1")


def test_buffer_built_with_chunks_but_not_allocated() -> None:
    msg = (
        "LatentBuffer `ring` holds 1 chunks but is not allocated; build it with "
        "`.allocate(...)` and `.commit(chunk)`."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        LatentBuffer(chunks=(torch.zeros(1),), name="ring", dim=0)


def test_buffer_built_with_more_chunks_than_its_ring() -> None:
    msg = (
        "LatentBuffer `ring` holds 3 chunks but its ring retains at most 2; build it with "
        "`.commit(chunk)`, which drops the oldest."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        LatentBuffer(chunks=(torch.zeros(1),) * 3, name="ring", dim=0, maxlen=2, allocated=True)


def test_session_built_with_a_non_state_object() -> None:
    msg = (
        "State object `x` must be a StateObject (e.g. LatentBuffer), got Tensor; carried "
        "values go in `attrs={'x': ...}`."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionState(objects={"x": torch.zeros(1)})  # type: ignore[dict-item]


def test_declaring_session_built_with_an_undeclared_attr() -> None:
    class Declaring(SessionState):
        step = SessionAttr(0)

    msg = (
        "`Declaring` declares no attribute `typo`; declared: ['step']. Declare it with "
        "`typo = SessionAttr(...)`."
    )
    with pytest.raises(AttributeError, match=_exact(msg)):
        Declaring(attrs={"typo": 1})


def test_a_name_in_both_buckets() -> None:
    msg = (
        "Session values ['ring'] are both state objects and attributes; a name lives in one "
        "bucket. Rename one, or `clear_attrs(...)` before `with_object(...)`."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        SessionState(objects={"ring": LatentBuffer()}, attrs={"ring": 1})
    with pytest.raises(ValueError, match=_exact(msg)):
        SessionState(attrs={"ring": 1}).with_object("ring", LatentBuffer())
    with pytest.raises(ValueError, match=_exact(msg)):
        SessionState(objects={"ring": LatentBuffer()}).with_attrs(ring=1)


def test_the_host_pool_and_prefetch_arguments() -> None:
    msg = (
        "`host_pool_full` must be 'disk' or 'refuse', got 'spill' (str): 'disk' spills a park "
        "the host pool cannot hold to the disk tier, 'refuse' refuses it."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        SessionStateManager(host_pool_full="spill")  # type: ignore[arg-type]
    msg = (
        "`host_pool_bytes` must be a positive byte count, got 0; pass None for no host pool, "
        "or the bytes the host tier may hold (e.g. '8GiB')."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        SessionStateManager(host_pool_bytes=0)
    msg = "`make_room` must be a bool (True or False), got 1."
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionStateManager().prefetch("a", make_room=1)  # type: ignore[arg-type]


def test_a_schedule_that_is_not_one() -> None:
    msg = (
        "`session_ids` must be a sequence of session ids in the order they run next, got "
        "'ab' (str); pass a list, e.g. `expect(['a', 'b'])` (and `expect([])` to clear the "
        "schedule)."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionStateManager().expect("ab")
    msg = "`prefetch` must be a bool (True or False), got 1 (int)."
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionStateManager().expect(["a"], prefetch=1)  # type: ignore[arg-type]


# --- coverage guard -------------------------------------------------------------------------

CORE_MESSAGES = {
    # Messages added for input checks and refusals are pinned in test_reliability_contracts.py;
    # on_full's, raise_max_sessions' and the eviction warning in test_upstream_parity.py; the
    # inference-mode warning in test_reliability.py; the snapshot message in its own file; the
    # budget's config messages in test_config_budget.py, its manager, parked and TensorCache
    # messages in test_park.py.
    "_accounting.py": 2 + 4,
    # The budget's device and zero-byte refusals are pinned in test_config_budget.py.
    # The KV pool's bytes, and per-device budget text: test_config_budget.py; so is the
    # host pool's `session_state_host_pool_full`.
    # (its bool fields' message is `_checks.a_bool`'s now.)
    # (`session_state_on_full` and `session_state_host_pool_full` are `check_choice`'s now.)
    "_config.py": 5 + 3 + 3 + 4 + 2 + 1,
    # The manager's messages, spread over the rooms it is built from (parse_nbytes's, in
    # the policy since the manager became a subpackage, is pinned in test_park.py).
    # (`check_immutable`, `max_sessions`, `on_full` and `host_pool_full` are checked by
    # `_checks` now.) The table: `raise_max_sessions` (two), the cap's refusal, the eviction
    # warning, the warning for host parking under a cpu-only budget (its `msg =` and its
    # `warn(`, messages/test_messages_park_tier.py), `pools` (two), `host_pool_bytes` and a
    # batch's ids (test_batch_io_messages).
    "_manager/_table.py": 2 + 1 + 1 + 2 + 2 + 1 + 1,
    # Get and put: a factory, `require`, a batch not held, a batch over the cap
    # (test_batch_io_messages), a batch over the whole budget (test_batch_budget_message), a
    # record that is not a SessionState, a parked session that cannot be read; then a batch
    # over the budget midway, while its later members still hold their old records.
    "_manager/_access.py": 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1,
    # Forks (4 + 1: a list of branch ids, test_fork.py), family snapshots (test_family_snapshot_*:
    # `snapshot`, `snapshot_many` two, a family not held, `restore_many` five).
    "_manager/_family.py": 4 + 1 + 1 + 2 + 1 + 5,
    "_manager/_observe.py": 1,  # `session_stats` of a session not held, pinned below
    "_manager/_prefetch.py": 1,  # `make_room` not a bool
    # A batched step's count of records (test_step_many.py), a pool short during a step.
    "_manager/_stepping.py": 1 + 1,
    "_manager/_policy.py": 5 + 2,  # a bare count and a device named twice: test_budget_forms.py
    "_manager/_parking.py": 2,
    "_manager/_guard.py": 2,
    "_manager/_schedule.py": 1,  # `expect` given no sequence: test_a_schedule_that_is_not_one
    # check_count (pinned through KVPool in test_kvpool.py), then the session-id rule (None
    # and NaN ids: pinned in test_session_ids.py), then the validators: `check_bool` (through
    # the manager's `check_immutable`, test_reliability_contracts.py), `a_bool` (through the
    # deploy config, above), `an_int` and `one_of` (the model configs'; `positive_int` raises
    # `check_count`'s), `check_choice` (`on_full` and `host_pool_full`, pinned above), and
    # `check_window`, the KV window of `KVPool.append` and `KVCache.append` (test_kvpool.py).
    "_checks.py": 1 + 1 + 2 + 4 + 1 + 2,
    "_objects.py": 4 + 3 + 3 + 5,  # with the chunk checks
    "_random.py": 3,  # the key's tensor, its seed, and use before `allocate`: pinned below
    # A parked object's refusal, pinned in test_park_reliability.py; then the two of one value
    # replaced wholesale (`SingleValueObject`: TensorCache's and KVCache's), in test_park.py.
    "_stateobject.py": 1 + 2,
    "_session.py": 6 + 2 + 1,  # `object(name, cls)` of another type: test_session.py
    "_tree.py": 2,
    "_frozen.py": 2,
    "_storage/_movers.py": 0,
    # Batches: no records, structures, non-tensor values and leaf shapes; then KV of two pools,
    # of two token counts, moved by the step, and rewritten by it (test_batch_kv_messages).
    "_batch.py": 4 + 4,
    # The KV pool's own (test_kvpool.py, test_kv_park.py), then `read_many`'s two (below).
    "_kv/_pool.py": 10 + 2,
    # A commit of something not a handle (test_park.py); a batched append to another pool or
    # of another token shape or dtype (test_batch_kv_messages).
    "_kv/_cache.py": 1 + 2 + 1,
}


def test_a_config_field_that_must_be_an_int() -> None:
    # `_checks.an_int`, the validator of both model configs' integer fields.
    from sessionstate.models.cosmos3 import Cosmos3Config
    from sessionstate.models.dreamzero import DreamZeroConfig

    for cls in (DreamZeroConfig, Cosmos3Config):
        msg = "`seed` must be an int, got 1.5 (float)."
        with pytest.raises(TypeError, match=re.escape(msg)):
            cls.preset("tiny", seed=1.5)


def test_manager_read_of_a_damaged_parked_session(tmp_path: Path) -> None:
    m = ss.SessionStateManager(max_bytes={"cpu": 64}, park_tier="disk", spool_dir=tmp_path)
    m.put("a", ss.SessionState(objects={"c": ss.TensorCache().allocate().commit(torch.ones(16))}))
    m.put("b", ss.SessionState(objects={"c": ss.TensorCache().allocate().commit(torch.ones(16))}))
    (path,) = tmp_path.rglob("*.safetensors")
    path.write_bytes(b"garbage")
    msg = (
        r"Cannot read parked session 'a' \(objects \['c'\]\) from the disk tier: .+\. The "
        r"session stays parked and intact; retry once the cause is fixed, or `drop` it\.$"
    )
    with pytest.raises(ss.ParkingError, match=msg):
        m.peek("a", on_host=True)


def test_bad_pools() -> None:
    msg = (
        "`pools` must be a tuple or list of engine pools, got {} (KVPool); pass `pools=(kv_pool,)`."
    )
    pool = ss.KVPool(1, block_tokens=1, token_shape=(), name="kv")
    with pytest.raises(TypeError, match=_exact(msg.format(repr(pool)))):
        SessionStateManager(pools=pool)  # type: ignore[arg-type]
    msg = (
        "`pools` holds 'kv' (str), which is not an engine pool: it needs `name`, "
        "`block_nbytes`, `num_blocks`, `free_blocks`, `session_blocks`, `owns_entry` and "
        "`blocks_for_step` (see `sessionstate.EnginePool`; a `KVPool` has them)."
    )
    with pytest.raises(TypeError, match=_exact(msg)):
        SessionStateManager(pools=("kv",))  # type: ignore[arg-type]


def test_a_step_the_pool_cannot_hold() -> None:
    pool = ss.KVPool(2, block_tokens=2, token_shape=(), name="kv", step_tokens=2)
    m = SessionStateManager(pools=(pool,))
    hog = pool.append(pool.empty(), torch.zeros(4))  # held outside the manager

    def grow(state: SessionState) -> tuple[SessionState, None]:
        kv = state.object("kv", ss.KVCache).append(pool, torch.ones(2))
        return state.with_object("kv", kv), None

    msg = (
        "Session 'a': a step can need 2 KV blocks (16 bytes) of pool 'kv', which has 0 free "
        "(0 bytes); live handles hold the other 16 bytes, and no other session's KV the "
        "manager holds is left to park (records kept outside the manager hold their blocks). "
        "Drop finished sessions, or build the pool with at least 32 bytes."
    )
    with pytest.raises(ss.KVPoolExhaustedError, match=_exact(msg)):
        m.step("a", grow, new=lambda: SessionState(objects={"kv": ss.KVCache().allocate()}))
    assert "a" not in m
    del hog


def test_stats_of_a_session_not_held() -> None:
    msg = (
        "No stats for session 'z': this manager does not hold it (never created, dropped, or "
        "evicted). `session_ids()` lists the held ones."
    )
    with pytest.raises(ss.SessionStateLostError, match=_exact(msg)):
        SessionStateManager().session_stats("z")


def test_random_key_messages() -> None:
    with pytest.raises(
        TypeError,
        match=_exact("A random key's `seed` must be an int, got '3' (str); pass e.g. `0`."),
    ):
        ss.RandomKey.seeded("3")  # type: ignore[arg-type]
    msg = (
        "Cannot draw from RandomKey `noise`: it is not allocated; call `.allocate(seed=...)` "
        "first (or build it with `RandomKey.seeded(seed)`)."
    )
    with pytest.raises(ss.NotAllocatedError, match=_exact(msg)):
        ss.RandomKey(name="noise").split(2)[0].normal((2,))  # a split key is not allocated
    msg = (
        "RandomKey `random_key` holds its key as an int64 tensor of shape (2,) (stream, "
        "counter), got a torch.int32 tensor of shape (2,); build keys with "
        "`RandomKey.seeded(seed)`."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ss.RandomKey(torch.zeros(2, dtype=torch.int32))
    msg = (
        "RandomKey `random_key` holds its key as an int64 tensor of shape (2,) (stream, "
        "counter), got [1, 2] (list); build keys with `RandomKey.seeded(seed)`."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ss.RandomKey([1, 2])  # type: ignore[arg-type]


def test_every_core_message_is_pinned_here() -> None:
    """A new `msg =` or `logger.warning` in a core module needs a test above, then a bump here."""
    src = Path(ss.__file__).parent
    found = {}
    for name in CORE_MESSAGES:
        text = (src / name).read_text(encoding="utf-8")
        found[name] = len(re.findall(r"\bmsg = |logger\.warning\(|warnings\.warn\(", text))
    assert found == CORE_MESSAGES


def test_batch_budget_message() -> None:
    import torch

    from sessionstate import SessionAdmissionError, SessionState
    from sessionstate import SessionStateManager as Manager

    m: Manager[SessionState] = Manager(max_bytes={"cpu": 100})
    pair = {sid: SessionState(attrs={"x": torch.zeros(20)}) for sid in "ab"}
    msg = (
        "Cannot store the batch ['a', 'b']: together it holds 160 bytes on cpu, more than the "
        "whole budget of 100 bytes there (`max_bytes`); storing it would evict or park every "
        "other session and still not fit. Store a smaller batch, or raise the budget for cpu."
    )
    with pytest.raises(SessionAdmissionError, match=re.escape(msg)):
        m.put_many(pair)


def test_fork_messages() -> None:
    from sessionstate import SessionAdmissionError, SessionState, SessionStateLostError
    from sessionstate import SessionStateManager as Manager

    m: Manager[SessionState] = Manager(max_sessions=2, on_full="refuse")
    m.put("a", SessionState())
    cases: list[tuple[type[Exception], str, tuple[str, ...]]] = [
        (
            ValueError,
            "`fork('a')` names no branch; pass the new ids: `fork(source, 'b1')`.",
            ("a",),
        ),
        (
            SessionStateLostError,
            "Cannot fork session 'x': this manager does not hold it (never created, dropped, "
            "or evicted). `session_ids()` lists the held ones.",
            ("x", "b"),
        ),
        (
            ValueError,
            "Cannot fork session 'a' into 'a': that id is the source. Name new ids (drop a "
            "session to reuse its id).",
            ("a", "a"),
        ),
        (
            SessionAdmissionError,
            "Cannot fork session 'a' into 2 branches: the cap (max_sessions=2) leaves 1 beside "
            "the source. Fork into fewer branches, drop finished sessions, or raise "
            "`max_sessions`.",
            ("a", "b", "c"),
        ),
    ]
    for error, text, args in cases:
        with pytest.raises(error) as caught:
            m.fork(*args)
        assert str(caught.value) == text


def test_family_snapshot_messages(tmp_path: Path) -> None:
    from sessionstate import SessionState, SessionStateLostError, save_state
    from sessionstate import SessionStateManager as Manager

    m: Manager[SessionState] = Manager()
    m.put("a", SessionState())
    path = tmp_path / "f.safetensors"
    with pytest.raises(ValueError, match="distinct") as caught:
        m.snapshot_many(["a", "a"], path)
    assert str(caught.value) == (
        "`snapshot_many` needs distinct session ids, got ['a', 'a']; name each session to save "
        "once."
    )
    with pytest.raises(SessionStateLostError) as lost:
        m.snapshot_many(["a", "b"], path)
    assert str(lost.value) == (
        "Cannot snapshot session 'b': this manager does not hold it (never created, dropped, "
        "or evicted). Nothing was written. `session_ids()` lists the held ones."
    )
    m.snapshot_many(["a"], path)
    with pytest.raises(ValueError, match="already held") as held:
        m.restore_many(path)
    assert str(held.value) == (
        "Cannot restore the family ['a']: ['a'] already held. Drop them first, or pass other "
        "`session_ids`."
    )
    with pytest.raises(ValueError, match="session ids were given") as count:
        m.restore_many(path, session_ids=["x", "y"])
    assert str(count.value) == (
        f"{str(path)!r} holds 1 records but 2 session ids were given; pass one id per record, "
        "in the file's order."
    )
    single = tmp_path / "one.safetensors"
    save_state(SessionState(), single)
    with pytest.raises(ss.SnapshotError) as one:
        m.restore_many(single)
    assert str(one.value) == (
        f"{str(single)!r} does not hold a family of session records (a list, as `snapshot_many` "
        "writes); load a one-session file with `restore`."
    )


def test_batch_io_messages() -> None:
    from sessionstate import SessionAdmissionError, SessionState, SessionStateLostError
    from sessionstate import SessionStateManager as Manager

    m: Manager[SessionState] = Manager(max_sessions=2, on_full="refuse")
    m.put("a", SessionState())
    with pytest.raises(SessionStateLostError) as lost:
        m.get_many(["a", "x"])
    assert str(lost.value) == (
        "Cannot get the batch ['a', 'x']: this manager does not hold ['x'] (never created, "
        "dropped, or evicted). Nothing changed. `session_ids()` lists the held ones."
    )
    with pytest.raises(ValueError, match="distinct") as twice:
        m.put_many([("a", SessionState()), ("a", SessionState())])
    assert str(twice.value) == (
        "`put_many` needs distinct session ids, got ['a', 'a']; name each session once."
    )
    with pytest.raises(SessionAdmissionError) as cap:
        m.put_many({"b": SessionState(), "c": SessionState()})
    assert str(cap.value) == (
        "Cannot store the batch ['b', 'c']: 2 new sessions beside 1 held, and the cap "
        "(max_sessions=2, `on_full='refuse'`) cannot hold the batch. Store a smaller batch, "
        "drop finished sessions, or raise `max_sessions`."
    )


def test_family_snapshot_refusals(tmp_path: Path) -> None:
    from sessionstate import SessionAdmissionError, SessionState, save_state
    from sessionstate import SessionStateManager as Manager

    m: Manager[SessionState] = Manager()
    m.put(1, SessionState())
    m.put("1", SessionState())
    with pytest.raises(ValueError, match="stores ids as text") as collide:
        m.snapshot_many([1, "1"], tmp_path / "x.safetensors")
    assert str(collide.value) == (
        "`snapshot_many` stores ids as text, and [1, '1'] would store two as one (['1', '1']); "
        "snapshot them to separate files, or use distinct str ids."
    )
    bad = tmp_path / "bad.safetensors"
    save_state([SessionState()], bad, metadata={"session_ids": "not json"})
    with pytest.raises(ss.SnapshotError) as listed:
        Manager().restore_many(bad)
    assert str(listed.value) == (
        f"{str(bad)!r} lists its session ids as 'not json', not a JSON list of strings as "
        "`snapshot_many` writes; pass `session_ids=`."
    )
    family = tmp_path / "family.safetensors"
    m.snapshot_many(["1"], family)
    small: Manager[SessionState] = Manager(max_sessions=1, on_full="refuse")
    small.put("z", SessionState())
    with pytest.raises(SessionAdmissionError) as cap:
        small.restore_many(family)
    assert str(cap.value) == (
        "Cannot restore the family ['1']: the cap (max_sessions=1, `on_full='refuse'`, 1 held) "
        "cannot hold it. Drop finished sessions, or raise `max_sessions`."
    )


def test_batch_kv_messages() -> None:
    import attrs

    from sessionstate._kv._cache import GatheredKV

    pool = ss.KVPool(8, block_tokens=2, token_shape=(), name="kv")
    other = ss.KVPool(8, block_tokens=2, token_shape=(), name="other")

    def record(p: ss.KVPool, n: int) -> ss.SessionState:
        cache = ss.KVCache(name="kv").allocate().append(p, torch.zeros(n))
        return ss.SessionState(objects={"kv": cache})

    a, b, c = record(pool, 3), record(other, 3), record(pool, 1)
    msg = (
        "Cannot stack the KV at objects['kv'].handle: record 0's handle is in KV pool 'kv' but "
        "record 1's is in pool 'other'. A batch reads its sessions' KV from one pool: step the "
        "sessions of each pool in separate batches."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ss.stack([a, b])
    msg = (
        "Cannot stack the KV at objects['kv'].handle: record 0 holds 3 tokens but record 1 "
        "holds 1. A batch needs one token count per KV (a shape bucket): step sessions of "
        "different lengths in separate batches."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ss.stack([a, c])

    def move(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, torch.Tensor]:
        cache = state.object("kv", ss.KVCache)
        return ss.SessionState(objects={"moved": cache}), x

    batch, _ = ss.vmap(move)(ss.stack([a, record(pool, 3)]), torch.zeros(2))
    msg = (
        "Cannot unstack the KV at objects['moved'].handle: the batch gathered KV at "
        "[\"objects['kv'].handle\"] only, and the step moved it. A batched step keeps each "
        "`KVCache` where it found it."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ss.unstack(batch)

    def rewrite(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, torch.Tensor]:
        kv = state.object("kv", ss.KVCache).view()
        moved = attrs.evolve(kv, tokens=kv.tokens + x)
        return ss.SessionState(
            objects={"kv": ss.KVCache(name="kv", handle=moved, allocated=True)}
        ), x

    batch, _ = ss.vmap(rewrite)(ss.stack([a, record(pool, 3)]), torch.ones(2))
    msg = (
        "Cannot unstack the KV at objects['kv'].handle of record 0: its 3 tokens do not begin "
        "with the 3 gathered from its handle. KV is append-only: a batched step extends it with "
        "`KVCache.append` and never rewrites or drops tokens."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ss.unstack(batch)

    gathered = GatheredKV(torch.zeros(3), pool=pool, gathered=3)
    msg = (
        "Cannot append to KV gathered from pool 'kv' with pool 'other' inside a batch: a "
        "batched step appends to the pool its sessions' KV is in. Step a session that moves to "
        "another pool on its own."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        gathered.append(other, torch.zeros(1))
    msg = (
        "KV pool 'kv' stores tokens of shape () and dtype torch.float32, got a `kv` of shape "
        "(1, 2) and dtype torch.float32; pass a tensor of shape (n, *()) of the pool's dtype."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        gathered.append(pool, torch.zeros(1, 2))
    msg = (
        "Cannot append to the empty KV cache 'kv' inside `vmap`: an empty (or reset) cache has "
        "no tokens gathered for the batch, and its first append must write the pool. Step "
        "sessions whose KV cache is empty or reset one by one, then batch them."
    )
    fresh = [record(pool, 1), record(pool, 1)]
    before = pool.free_blocks

    def restart(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, torch.Tensor]:
        cache = state.object("kv", ss.KVCache).reset().append(pool, x[None])
        return state.with_object("kv", cache), x

    with pytest.raises(ValueError, match=_exact(msg)):
        ss.vmap(restart)(ss.stack(fresh), torch.ones(2))
    assert pool.free_blocks == before  # the pool untouched


def test_read_many_messages() -> None:
    from sessionstate._kv._pool import read_many

    pool = ss.KVPool(8, block_tokens=2, token_shape=(), name="kv")
    long, short = (pool.append(pool.empty(), torch.zeros(n)) for n in (3, 1))
    msg = "`read_many` needs at least one handle; pass the handles of the sessions to read."
    with pytest.raises(ValueError, match=_exact(msg)):
        read_many([])
    msg = (
        "`read_many` reads handles of one token count (a shape bucket): handle 0 reads 3 "
        "tokens but handle 1 reads 1. Read the handles of each token count together."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        read_many([long, short])


def test_a_budget_text_is_refused_with_one_message_wherever_it_is_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sessionstate.cli import main

    msg = (
        "`max_bytes['cpu']` must be a byte count: a non-negative int or a string like '24GiB', "
        "'512MiB' or '1.5GB'; got 'lots' (str)."
    )
    with pytest.raises(ss.BudgetTextError, match=_exact(msg)) as info:
        ss.SessionStateManager(max_bytes="cpu=lots")
    assert (info.value.rule, info.value.part) == ("count", "lots")
    assert main(["ab", "--max-bytes", "cpu=lots"]) == 2
    assert capsys.readouterr().err == (
        f"sessionstate ab: error: argument --max-bytes: {msg.rstrip('.')} "
        "(see `sessionstate ab --help`)\n"
    )


def test_metrics_without_their_extra_say_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from sessionstate.metrics import SessionStateCollector

    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    msg = (
        "Metrics need `prometheus_client`: install the `metrics` extra from your clone, "
        "`pip install -e '.[metrics]'` (no release of sessionstate is on PyPI yet)."
    )
    with pytest.raises(ImportError, match=_exact(msg)):
        SessionStateCollector(SessionStateManager())


def test_keep_branch_refuses_the_session_as_its_own_branch() -> None:
    from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline
    from sessionstate.models.planning import keep_branch

    msg = (
        "`keep_branch` needs a branch other than the session, got 's' for both; pass the id "
        "of a branch forked from it."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        keep_branch(Cosmos3Pipeline(Cosmos3Config.preset("tiny")), "s", "s")


# --- _compile -------------------------------------------------------------------------------


def _ring_step(state: SessionState, x: torch.Tensor) -> tuple[SessionState, torch.Tensor]:
    state = state.update_object("r", lambda r: r.commit(x))
    return state, x


def test_compiled_step_structure_bound() -> None:
    fast = ss.compile(_ring_step, backend="aot_eager", max_structures=1)
    state = SessionState(objects={"r": LatentBuffer(dim=0).allocate(maxlen=2)})
    state, _ = fast(state, torch.ones(1))
    msg = (
        "`_ring_step` met a new input structure after compiling for 1 (`max_structures=1`). "
        "Each new treespec, static field, tensor shape, dtype or device compiles once, as "
        "`jax.jit` retraces; a value that changes every step (a str attribute, a growing "
        "shape) recompiles every step. Make it a tensor or keep it out of the record, or "
        "raise `max_structures`."
    )
    with pytest.raises(ss.RecompileLimitError, match=_exact(msg)):
        fast(state, torch.ones(1))


def test_compiled_step_max_structures_checked() -> None:
    msg = (
        "`max_structures` must be a positive int, got 0 (int); it bounds the input "
        "structures a compiled step compiles for."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        ss.compile(_ring_step, max_structures=0)


def test_compiled_step_donated_record_used_again() -> None:
    fast = ss.compile(_ring_step, backend="aot_eager", donate=True)
    state = SessionState(objects={"r": LatentBuffer(dim=0).allocate(maxlen=2)})
    for _ in range(3):
        state, _ = fast(state, torch.ones(1))
    new, _ = fast(state, torch.ones(1))
    msg = (
        f"This `SessionState` was donated to an earlier call of {fast!r}, which wrote its "
        "successor into its tensors; step from the record that call returned, or compile "
        "with `donate=False` to keep every record."
    )
    with pytest.raises(ss.DonatedRecordError, match=_exact(msg)):
        fast(state, torch.ones(1))
    del new
