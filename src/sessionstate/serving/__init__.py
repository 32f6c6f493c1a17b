"""Serving under load: open-loop sessions at their chunk deadlines, on two clocks, one manager.

- `Load`, `arrivals`: Poisson session arrivals, geometric lengths, deterministic per seed.
- `serve_loop`: the server loop both clocks share (deadlines, earliest deadline first,
  batches) and its metrics in upstream's vocabulary (`Run.metrics`).
- `SimulatedServer`, `simulate`, `sweep`: the simulated clock, where a real
  `SessionStateManager` makes every decision over scale models of deploy-sized records and
  copies run on two lanes at a stated bandwidth; `DeployShape` and the shapes `LINGBOT`,
  `SANA_WM`, `dreamzero_shape`.
- `DeadlineAdmission`: admit a session only while held sessions still meet their deadlines;
  `DeadlineAdmissionError` otherwise, naming the limit and the rate.
- `serve_realtime`: the real-time clock, tiny reference models stepped for real.

See ``docs/performance.md`` ("Serving under load") for the figures and what they assume.
"""

from sessionstate.serving._admission import DeadlineAdmission, DeadlineAdmissionError
from sessionstate.serving._load import Arrival, DeployShape, Load, arrivals
from sessionstate.serving._run import SUSTAINED, is_sustained, simulate, sustained_sessions, sweep
from sessionstate.serving._server import Backend, ChunkRecord, Run, percentile, serve_loop
from sessionstate.serving._shapes import H200_NBYTES, LINGBOT, SANA_WM, dreamzero_shape
from sessionstate.serving._sim import POLICIES, SCALE, Policy, SimulatedServer

__all__ = [
    "H200_NBYTES",
    "LINGBOT",
    "POLICIES",
    "SANA_WM",
    "SCALE",
    "SUSTAINED",
    "Arrival",
    "Backend",
    "ChunkRecord",
    "DeadlineAdmission",
    "DeadlineAdmissionError",
    "DeployShape",
    "Load",
    "Policy",
    "Run",
    "SimulatedServer",
    "arrivals",
    "dreamzero_shape",
    "is_sustained",
    "percentile",
    "serve_loop",
    "simulate",
    "sustained_sessions",
    "sweep",
]
