"""Markdown charts for the UI's metadata."""

from __future__ import annotations

import numpy as np

from fabric_pipelines.lib.charts import bar, bar_table, length_histogram


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


def test_recall_bars_are_drawn_on_a_zero_to_one_scale_and_zeros_show_no_backticks() -> None:
    from fabric_pipelines.lib.index.publish import recall_curve_chart

    chart = recall_curve_chart(
        {"recall_at_1": 0.5, "recall_at_10": 0.75, "recall_at_100": 1.0, "k": 10}
    )
    cells = {
        line.split("|")[1].strip(): line.split("|")[3].strip() for line in chart.splitlines()[2:]
    }
    # Half of a full bar for 0.5, not a full bar (the largest value is 1.0 here, but the
    # scale must not depend on it).
    assert cells["recall@1"] == "`" + "█" * 15 + "`" and cells["recall@100"] == "`" + "█" * 30 + "`"
    only_low = recall_curve_chart({"recall_at_1": 0.5, "k": 10})
    assert only_low.splitlines()[2].split("|")[3].strip() == "`" + "█" * 15 + "`"
    table = bar_table(["none", "some"], [0, 3], ("k", "v"))
    assert table.splitlines()[2] == "| none | 0 |  |" and "``" not in table
