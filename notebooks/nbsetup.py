"""What every notebook sets up first: the Agg backend, one torch thread, and `show`.

Each notebook starts with ``from nbsetup import GiB, KiB, MiB, plt, show``. Figures are
drawn at the docs' width (7 inches at 100 dpi: 700 pixels) with legible legend text.
``SESSIONSTATE_FIGURES``, when set (``make notebooks`` sets it), names a folder where `show`
also saves a figure it is given a name for; a plain run (CI, Jupyter) writes no file. Run
as a plain script (``python notebooks/NN_name.py``, no IPython kernel), `show` prints one line
saying where the figure went instead of ``<IPython.core.display.Image object>``.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable

import IPython.display
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

__all__ = ["DPI", "WIDTH", "GiB", "KiB", "MiB", "plt", "show"]

KiB, MiB, GiB = 1024, 1024**2, 1024**3
WIDTH = 7.0  # inches: 700 pixels at DPI, the width of the docs' text column
DPI = 100

# Tiny tensors: one thread is fastest, and steady on a busy CI runner.
torch.set_num_threads(1)
# diffusers imports tqdm.auto, which warns that ipywidgets is missing; no bar is shown here.
warnings.filterwarnings("ignore", message="IProgress not found")
# IPython's display functions are not annotated; these are their types as used here.
_display: Callable[[object], object] = IPython.display.display
_png: Callable[[bytes], object] = IPython.display.Image
_kernel: Callable[[], object | None] = IPython.get_ipython
plt.rcParams.update({"font.size": 10, "legend.fontsize": 9, "figure.dpi": DPI})


def show(fig: Figure, name: str | None = None) -> None:
    """Display ``fig`` as a PNG; also save it as ``name`` where ``SESSIONSTATE_FIGURES`` says."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    figures = os.environ.get("SESSIONSTATE_FIGURES")
    if name and figures:
        path = os.path.join(figures, name)
        fig.savefig(path, dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    if _kernel() is None:  # a plain `python notebooks/NN_name.py`: nothing can display it
        title = name or next((ax.get_title() for ax in fig.axes if ax.get_title()), "untitled")
        where = f"saved as {os.path.join(figures, name)}" if name and figures else "not shown"
        print(
            f"[figure ({title}): {where}; to see it, open the .ipynb in Jupyter: "
            "pip install -e '.[notebooks]', then jupyter lab notebooks/]"
        )
        return
    _display(_png(buf.getvalue()))
