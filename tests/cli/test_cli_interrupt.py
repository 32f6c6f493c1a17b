"""Ctrl-C stops a subcommand at the first signal: one line, exit 130, no child left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

# A shell script's background job starts with SIGINT ignored, and so does what it execs: the
# way `timeout -s INT 20 sessionstate ab &` runs from a script, where the first signal used to
# be ignored and `ab` ran to the end.
_SIGINT_IGNORED = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]


def _episode_children(proc: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return [c for c in proc.children(recursive=True) if "_episode" in c.cmdline()]
    return []


def test_sigint_to_ab_alone_stops_it_and_its_children_even_if_started_ignoring_it() -> None:
    argv = [sys.executable, "-m", "sessionstate.cli", "ab", "--steps", "50", "--json"]
    proc = subprocess.Popen(
        [*_SIGINT_IGNORED, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: what is left of it can be found
    )
    group = proc.pid
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 120
        children: list[psutil.Process] = []
        while not children and proc.poll() is None and time.monotonic() < deadline:
            children = _episode_children(parent)
            time.sleep(0.2)
        assert children, "ab never started its first episode"
        time.sleep(1.0)  # the episode is under way
        proc.send_signal(signal.SIGINT)  # to `ab` alone, not its group
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1] == "sessionstate ab: interrupted"
        assert "Traceback" not in err
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"episodes left running: {alive}"
        left = [p for p in psutil.process_iter() if _group(p) == group]
        assert not left, f"processes left in ab's group: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        proc.wait()


def _group(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except (ProcessLookupError, PermissionError):
        return None
