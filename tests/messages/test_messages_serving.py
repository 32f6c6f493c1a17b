"""The load harness's messages: bad loads, shapes and admissions, refused before a run."""

from __future__ import annotations

import re

import attrs
import pytest

from sessionstate.serving import LINGBOT, DeadlineAdmission, DeadlineAdmissionError, Load, sweep


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        (
            {"rate": 0},
            "`rate` must be a positive finite number, got 0 (int); give session arrivals per "
            "second, such as 0.5.",
        ),
        (
            {"rate": float("nan")},
            "`rate` must be a positive finite number, got nan (float); give session arrivals "
            "per second, such as 0.5.",
        ),
        (
            {"rate": -1.0},
            "`rate` must be a positive finite number, got -1.0 (float); give session arrivals "
            "per second, such as 0.5.",
        ),
        (
            {"mean_chunks": 0.5},
            "`mean_chunks` must be at least 1 (a session has at least one chunk), got 0.5; give "
            "the mean session length in chunks, such as 40.",
        ),
        (
            {"mean_chunks": float("inf")},
            "`mean_chunks` must be a positive finite number, got inf (float); give the mean "
            "session length in chunks, such as 40.",
        ),
        (
            {"duration_s": 0.0},
            "`duration_s` must be a positive finite number, got 0.0 (float); give the seconds "
            "arrivals last, such as 600.",
        ),
    ],
)
def test_a_bad_load_is_refused_naming_the_value_and_the_fix(
    kwargs: dict[str, float], msg: str
) -> None:
    args = {"rate": 0.5, "mean_chunks": 40.0, "duration_s": 60.0, **kwargs}
    with pytest.raises(ValueError, match=re.escape(msg)):
        Load(**args)  # type: ignore[arg-type]


def test_a_zero_bandwidth_is_refused() -> None:
    msg = (
        "`bandwidth` must be a positive finite number, got 0.0 (float); give bytes per second "
        "each way, such as 50e9."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        attrs.evolve(LINGBOT, bandwidth=0.0)


def test_a_negative_deadline_is_refused() -> None:
    msg = (
        "`chunk_period_s` must be a positive finite number, got -0.75 (float); give the "
        "seconds a chunk plays."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        attrs.evolve(LINGBOT, chunk_period_s=-0.75)


def test_an_impossible_deadline_is_refused_before_anything_runs() -> None:
    # Upstream's measured LingBot step (about 5 FPS: 2.4 s per 12-frame chunk).
    msg = (
        "Shape 'lingbot': one session's step takes 2.4 s, longer than `chunk_period_s` 0.75 s, "
        "so no session can meet its deadlines; give a shorter step or a longer "
        "`chunk_period_s`."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        attrs.evolve(LINGBOT, step_s=(2.4,))


def test_a_device_too_small_for_one_session_is_refused() -> None:
    msg = (
        "Shape 'lingbot': the device's 50000000000 bytes less the 30064771072 the model holds "
        "cannot hold one session of 25306794557 bytes; give a larger device or a smaller "
        "session."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        attrs.evolve(LINGBOT, device_nbytes=50 * 10**9)


def test_a_bad_rate_in_a_sweep_is_refused_before_any_run() -> None:
    msg = (
        "`rates` must be a positive finite number, got nan (float); give positive arrival "
        "rates, such as 0.05."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        sweep(LINGBOT, [0.1, float("nan")], mean_chunks=10, duration_s=10)


def test_admission_by_deadline_names_the_limit_and_the_rate() -> None:
    adm = DeadlineAdmission.planned(LINGBOT)
    msg = (
        "Cannot admit session 'late': 5 sessions would need 0.500 s of steps and 0.633 s of "
        "copies each way per 0.750 s chunk period, over the 0.675 s (90%) this server fills, "
        "so held sessions would miss their deadlines. Its limit at this deadline is 4 "
        "sessions, 5.33 chunks per second (0.100 s per step, 0.506 s per swap each way, 4 "
        "sessions resident). Retry later, or offer sessions at a lower rate."
    )
    adm.admit("late", held=3)
    with pytest.raises(DeadlineAdmissionError, match=re.escape(msg)):
        adm.admit("late", held=4)


def test_a_headroom_over_one_is_refused() -> None:
    msg = "`headroom` must be at most 1 (the whole period), got 1.5."
    with pytest.raises(ValueError, match=re.escape(msg)):
        DeadlineAdmission(chunk_period_s=1.0, step_s=(0.1,), swap_s=0.0, resident=1, headroom=1.5)
