"""A griffe extension: render the ``>>>`` examples in our docstrings as Python code blocks.

Our docstrings carry runnable ``>>>`` examples in their prose (pytest collects them as
doctests), not under an ``Examples:`` section. Markdown reads ``>>>`` as three nested block
quotes and ``x[0]`` as a reference link, so each run of doctest lines (from a ``>>>`` line
to the next blank line) is fenced as ``pycon`` before mkdocstrings renders the docstring.
Only the rendered text changes; the source and the doctests are untouched.
"""

from __future__ import annotations

from typing import Any

import griffe

__all__ = ["DoctestFences", "fence_doctests"]


def fence_doctests(text: str) -> str:
    r"""Wrap every run of doctest lines in ``text`` in a ```` ```pycon ```` fence.

    >>> fence_doctests("Sum:\n>>> 1 + 1\n2\n\nDone.")
    'Sum:\n```pycon\n>>> 1 + 1\n2\n```\n\nDone.'
    """
    out: list[str] = []
    in_fence = False
    in_doctest = False
    indent = ""
    for line in text.splitlines():
        stripped = line.lstrip()
        if in_doctest and not stripped:
            out.append(f"{indent}```")
            in_doctest = False
        if not in_doctest and stripped.startswith(("```", "~~~")):
            in_fence = not in_fence
        elif not in_fence and not in_doctest and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            in_doctest = True
        out.append(line)
    if in_doctest:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the doctest examples of every object griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring (if any) with its doctests fenced."""
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
