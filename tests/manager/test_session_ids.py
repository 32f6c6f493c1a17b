"""Session ids: None and NaN are refused everywhere an id enters, with one message each.

None almost always means a missing id (the pipelines default to ``"default"``); NaN is
unequal to itself, so a session stored under it could never be read again.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sessionstate import ENV_ENABLE, SessionState, SessionStateManager
from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline, Cosmos3Request
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode

NONE_MSG = (
    "`session_id` must not be None: None almost always means a missing id. Pass the session's "
    "id (any hashable value such as a str or an int; the model pipelines default to "
    "'default')."
)


def _nan_msg(sid: object) -> str:
    return (
        f"`session_id` must equal itself, got {sid!r} ({type(sid).__name__}), which is or "
        "holds NaN: a session stored under it could never be read again. Pass an id such as a "
        "str or an int."
    )


NANS = [
    float("nan"),
    math.nan,
    ("user", float("nan")),
    frozenset({float("nan")}),
    complex(0, math.nan),
]


def _manager_calls(m: SessionStateManager[SessionState]) -> list[Callable[[Any], object]]:
    return [
        m.get,
        m.peek,
        m.require,
        m.drop,
        lambda sid: m.put(sid, SessionState()),
        lambda sid: m.get_or_create(sid, SessionState),
    ]


def test_the_manager_refuses_none_and_nan_everywhere() -> None:
    m = SessionStateManager[SessionState]()
    m.put("held", SessionState())
    for call in _manager_calls(m):
        with pytest.raises(TypeError, match=re.escape(NONE_MSG)):
            call(None)
        for sid in NANS:
            with pytest.raises(ValueError, match=re.escape(_nan_msg(sid))):
                call(sid)
    assert m.session_ids() == ["held"]
    assert (m.stats()["hits"], m.stats()["misses"]) == (0, 0)


def _dz(flag: str) -> tuple[DreamZeroPipeline, Any]:
    cfg = DreamZeroConfig.preset("tiny")
    pipe = DreamZeroPipeline(cfg, environ={ENV_ENABLE: flag})
    ((_, obs),) = scripted_episode(cfg, steps=1, sessions=1, seed=0)
    return pipe, obs


def _c3(flag: str) -> tuple[Cosmos3Pipeline, Any]:
    pipe = Cosmos3Pipeline(Cosmos3Config.preset("tiny"), environ={ENV_ENABLE: flag})
    return pipe, Cosmos3Request("a red car", torch.zeros(4))


@pytest.mark.parametrize("flag", ["0", "1"])
@pytest.mark.parametrize("build", [_dz, _c3], ids=["dreamzero", "cosmos3"])
def test_both_models_refuse_none_and_nan_on_both_paths(
    build: Callable[[str], tuple[Any, Any]], flag: str
) -> None:
    pipe, step_input = build(flag)
    pipe.forward(step_input)  # the default id
    readers = [
        lambda sid: pipe.forward(step_input, sid),
        lambda sid: pipe.forward(step_input, sid, begin=True),
        pipe.drop_session,
        pipe.session_values,
        pipe.video_latents,
    ]
    if hasattr(pipe, "clear_accumulated_video_latents"):
        readers.append(pipe.clear_accumulated_video_latents)
    for call in readers:
        with pytest.raises(TypeError, match=re.escape(NONE_MSG)):
            call(None)
        for sid in NANS:
            with pytest.raises(ValueError, match=re.escape(_nan_msg(sid))):
                call(sid)
    assert pipe.session_ids() == ["default"]


def test_ids_that_equal_themselves_are_still_accepted() -> None:
    m = SessionStateManager[SessionState]()
    for sid in ("a", 0, -1.5, math.inf, ("user", 7), frozenset({1}), b"raw", True):
        m.put(sid, SessionState())
        assert m.get(sid) is not None
