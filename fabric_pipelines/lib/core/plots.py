"""Bar charts as small PNG images, embedded in Markdown metadata as data URIs: the Dagster UI
renders Markdown images, and a picture reads faster than a column of numbers. Each chart is
shown above its table, so the numbers stay exact and searchable."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont

WIDTH = 640
ROW = 22  # pixels per bar
MARGIN = 8
BAR_COLOUR = (66, 99, 235)  # Dagster's blue
TRACK_COLOUR = (233, 236, 244)  # the full-scale track behind a bar on a fixed scale
TEXT_COLOUR = (40, 40, 40)
# A chart is a data URI inside the run's metadata: kept well under what the UI loads quickly.
MAX_BYTES = 100_000


def bar_chart_png(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    title: str,
    fmt: str = "{:,}",
    full: float | None = None,
) -> bytes:
    """One horizontal bar per label. A full bar is `full` (recall: 1.0; a grey track shows the
    scale), else the largest value."""
    if len(labels) != len(values):
        raise ValueError(f"{len(labels)} labels for {len(values)} values")
    font = ImageFont.load_default(size=13)
    label_width = max((font.getlength(label) for label in labels), default=0.0)
    value_width = max((font.getlength(fmt.format(v)) for v in values), default=0.0)
    left = int(MARGIN + label_width + MARGIN)
    span = WIDTH - left - int(value_width) - 3 * MARGIN
    height = MARGIN + ROW + ROW * len(labels) + MARGIN
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((MARGIN, MARGIN), title, fill=TEXT_COLOUR, font=font)
    largest = full if full is not None else max((float(v) for v in values), default=0.0)
    for row, (label, value) in enumerate(zip(labels, values, strict=True)):
        top = MARGIN + ROW * (row + 1)
        draw.text((MARGIN, top + 3), label, fill=TEXT_COLOUR, font=font)
        if full is not None:
            draw.rectangle((left, top + 3, left + span - 1, top + ROW - 4), fill=TRACK_COLOUR)
        length = round(span * min(float(value), largest) / largest) if largest > 0 else 0
        if length > 0:
            draw.rectangle((left, top + 3, left + length - 1, top + ROW - 4), fill=BAR_COLOUR)
        text_left = left + (span if full is not None else max(length, 0)) + MARGIN
        draw.text((text_left, top + 3), fmt.format(value), fill=TEXT_COLOUR, font=font)
    out = io.BytesIO()
    # A few flat colours: a palette image compresses to a few kilobytes.
    image.quantize(colors=16).save(out, format="PNG", optimize=True)
    png = out.getvalue()
    if len(png) > MAX_BYTES:
        raise ValueError(f"chart {title!r} is {len(png):,} bytes (limit {MAX_BYTES:,})")
    return png


def markdown_image(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"


def chart_and_table(
    labels: Sequence[str],
    values: Sequence[float],
    header: tuple[str, str],
    *,
    title: str,
    fmt: str = "{:,}",
    full: float | None = None,
) -> str:
    """The chart as an image, then the same numbers as a Markdown table."""
    png = bar_chart_png(labels, values, title=title, fmt=fmt, full=full)
    rows = [f"| {header[0]} | {header[1]} |", "|---|---:|"]
    rows += [f"| {label} | {fmt.format(v)} |" for label, v in zip(labels, values, strict=True)]
    return f"{markdown_image(png, title)}\n\n" + "\n".join(rows)
