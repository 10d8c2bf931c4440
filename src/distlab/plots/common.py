"""What every figure shares: a run's label, the hardware in a title, an animation as HTML."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..config import TrainConfig
from ..results import hardware_label


def run_label(record: dict) -> str:
    """A training run as a legend entry: strategy, ranks, and what differs from the defaults."""
    cfg, default = record["config"], TrainConfig()
    ranks = record["environment"]["world_size"]
    extras = [cfg["data"]["loader"]]
    if cfg["training"]["batch_size"] != default.training.batch_size:
        extras.append(f"batch {cfg['training']['batch_size']}")
    if cfg["precision"]["dtype"] != default.precision.dtype:
        extras.append(cfg["precision"]["dtype"])
    return f"{cfg['parallel']['strategy']} ({ranks} rank{'s' if ranks > 1 else ''}, {', '.join(extras)})"


def _hardware_title(records: Sequence[dict]) -> str:
    labels = sorted({hardware_label(r["environment"]) for r in records})
    return "measured on " + "; ".join(labels)


def jshtml(animation, default_mode: str = "once") -> str:
    """An animation as HTML and JavaScript that plays on a static page, offline.
    matplotlib's player links Font Awesome 4.4 from a CDN for its button icons;
    the book's theme ships Font Awesome 6, which draws them, so the link goes."""
    html = animation.to_jshtml(default_mode=default_mode)
    return re.sub(r'<link rel="stylesheet"\s+href="https://[^"]*font-awesome[^"]*">', "", html)


# The book's content column: 688 px wide in the Jupyter Book 1.x theme at a 1280 px window, and the pages draw at
# figure.dpi 100. A picture of who holds and sends what is drawn at most this wide, so the page does not scale it
# down, and its every text at least MIN_TEXT_PT.
COLUMN_PX = 688
COLUMN_INCHES = 6.8  # 680 px at 100 dpi: tight_layout's bounding box stays inside the column
MIN_TEXT_PT = 9


def fit_to_column(fig) -> None:
    """Narrow ``fig`` to the book's column where it is wider (a page may hand a wider figure in), keeping its
    height: its text then shows at the size it was set in."""
    width, height = fig.get_size_inches()
    if width > COLUMN_INCHES:
        fig.set_size_inches(COLUMN_INCHES, height)
