"""Charts for the UI's metadata: Markdown tables with text bars, and PNG plots."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image

from fabric_pipelines.lib.core.charts import bar, bar_table, length_histogram, power_of_two_bins
from fabric_pipelines.lib.core.plots import BAR_COLOUR, MARGIN, ROW, TRACK_COLOUR, bar_chart_png


def test_bars_scale_to_the_largest_value_in_eighths() -> None:
    assert bar(10, 10, width=4) == "████"
    assert bar(5, 10, width=4) == "██"
    assert bar(1, 16, width=4) == "▎"  # 2 eighths
    assert bar(0, 10) == "" and bar(3, 0) == ""


def test_length_histogram_counts_each_power_of_two_range() -> None:
    chart = length_histogram(np.array([1, 8, 9, 16, 17, 500]))
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip() for line in chart.splitlines()[2:]
    }
    assert rows["1–8"] == "2" and rows["9–16"] == "2" and rows["17–32"] == "1"
    assert rows["257–512"] == "1" and rows["129–256"] == "0"
    assert sum(int(v) for v in rows.values()) == 6


def test_bar_table_formats_values() -> None:
    table = bar_table(["a", "b"], [0.5, 0.25], ("k", "v"), "{:.2f}")
    assert table.splitlines()[2].startswith("| a | 0.50 | `")


def _images(markdown: str) -> list[Image.Image]:
    """The PNG images embedded in Markdown metadata as data URIs."""
    found = re.findall(r"!\[[^\]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    return [Image.open(io.BytesIO(base64.b64decode(data))) for data in found]


def _pixels(image: Image.Image, colour: tuple[int, int, int]) -> list[int]:
    """Pixels of `colour` across the middle of each row of bars (the title row has none)."""
    rgb = np.asarray(image.convert("RGB")).astype(int)
    found = (np.abs(rgb - np.array(colour)).sum(axis=2) < 6).sum(axis=1)
    return [int(found[top + ROW // 2]) for top in range(MARGIN + ROW, image.height - MARGIN, ROW)]


def _bar_lengths(image: Image.Image) -> list[int]:
    return _pixels(image, BAR_COLOUR)


def _filled(image: Image.Image) -> list[float]:
    """Each bar's share of its full-scale track (charts with a fixed scale draw the track)."""
    bars, tracks = _bar_lengths(image), _pixels(image, TRACK_COLOUR)
    return [b / (b + t) for b, t in zip(bars, tracks, strict=True)]


def test_recall_plots_are_drawn_on_a_zero_to_one_scale_beside_their_numbers() -> None:
    from fabric_pipelines.lib.index.report import recall_curve_chart

    chart = recall_curve_chart(
        {
            "recall_at_1": 0.5,
            "recall_at_10": 0.75,
            "recall_at_100": 1.0,
            "k": 10,
            "nprobe_curve": {"1": 0.25, "8": 0.68},
        }
    )
    at_k, curve = _images(chart)
    one, ten, hundred = _filled(at_k)
    # Half a full bar for 0.5: the scale is 1.0, not the largest value drawn.
    assert abs(one - 0.5) < 0.01 and abs(ten - 0.75) < 0.01 and hundred == 1.0
    low, high = _filled(curve)
    assert abs(low - 0.25) < 0.01 and abs(high - 0.68) < 0.01
    assert "| recall@1 | 0.5000 |" in chart and "| nprobe 8 | 0.6800 |" in chart


def test_a_plot_is_a_small_png_and_counts_scale_to_the_largest() -> None:
    labels, counts = power_of_two_bins(np.array([1, 8, 9, 16, 17, 500] * 50))
    png = bar_chart_png(labels, counts, title="tasks per length")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 20_000
    lengths = _bar_lengths(Image.open(io.BytesIO(png)))
    assert len(lengths) == len(labels) == 7
    assert lengths[0] == lengths[1] == max(lengths) and lengths[labels.index("129–256")] == 0
    with pytest.raises(ValueError, match="2 labels for 1 values"):
        bar_chart_png(["a", "b"], [1.0], title="t")


def test_zeros_show_no_backticks_in_text_bars() -> None:
    table = bar_table(["none", "some"], [0, 3], ("k", "v"))
    assert table.splitlines()[2] == "| none | 0 |  |" and "``" not in table
