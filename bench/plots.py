"""What every benchmark plot shares: the trace's attribution and how a figure is saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The credit every plot of the bundled trace carries (CC-BY 4.0 asks for it).
ATTRIBUTION = (
    "Trace: Azure LLM inference trace 2023 (conversation), Patel et al., 'Splitwise', ISCA 2024; CC-BY 4.0"
)


def save_figure(fig: Any, path: Path, attribution: str = ATTRIBUTION) -> Path:
    """Write ``fig`` (a matplotlib Figure) to ``path`` as a 110-dpi PNG with ``attribution`` (by default
    :data:`ATTRIBUTION`, the bundled trace's) at its foot, close it, and return ``path``."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 - a benchmark-only dependency

    fig.text(0.01, 0.01, attribution, fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
