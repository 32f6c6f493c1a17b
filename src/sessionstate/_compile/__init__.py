"""Compiled steps: a whole ``step(state, *inputs) -> (state, out)`` under `torch.compile`.

`compile` traces a step with ``fullgraph=True`` (records trace natively), bounds the input
structures it compiles for, and can donate the record given: its successor is written into the
storages nothing else holds, so addresses stay put from step to step.
"""

from sessionstate._compile._step import DEFAULT_MAX_STRUCTURES, CompiledStep, compile

__all__ = ["DEFAULT_MAX_STRUCTURES", "CompiledStep", "compile"]
