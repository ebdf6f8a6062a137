"""`fabric plan FILE`: what a job will be, before any of it runs. The file is read and tokenised
as ingest would (nothing is stored), the tasks whose content key already has a stored result are
counted as reused (lib/broker/reuse.py) and so are repeats inside the file, the rest are planned into
the batches the engine would run, and the time is predicted from this engine's measured speed
(engine_speeds.py), or not at all when it was never measured here."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Engine, select

from fabric_gpu.batching import plan_batches, prefix_keys
from fabric_gpu.engines import input_layout
from fabric_gpu.engines.identity import planned_identity
from fabric_gpu.manifest import EngineManifest
from fabric_gpu.model import load_tokenizer, resolve_model_dir
from fabric_pipelines.lib.broker.reuse import content_keys, reuse_enabled, stored_keys
from fabric_pipelines.lib.core.charts import power_of_two_bins
from fabric_pipelines.lib.records.engine_speeds import Prediction, engine_device, predict
from fabric_pipelines.lib.store.models import WINDOW_BASE, Model
from fabric_pipelines.lib.tasks.ingest import TokenisedTasks, ingest
from fabric_pipelines.lib.tasks.windows import LongInputs


@dataclass(frozen=True)
class PlanPreview:
    file: str
    model_key: str
    layout: str
    device: str
    records: int
    tasks: int
    failed: int
    failure_kinds: dict[str, int]  # over-long, empty text, ... -> records
    truncated: int
    chunked: int  # documents split into windows (their windows are among `tasks`)
    windows: int
    reused: int  # tasks whose content already has a stored result: copied, not computed
    repeats: int  # tasks repeating another's content inside the file: computed once
    real_tokens: int  # of the tasks the engine would compute
    length_histogram: list[tuple[str, int]]  # (token range, tasks)
    batches: int
    padded_tokens: int
    shapes: int
    prediction: Prediction | None

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def to_mapping(self) -> dict[str, Any]:
        measured: dict[str, Any] | None = None
        if self.prediction is not None:
            measured = {
                "padded_tokens_per_second": round(self.prediction.padded_tokens_per_second, 1),
                "source": self.prediction.measured.source,
                "at": self.prediction.measured.measured_at.isoformat(timespec="seconds"),
            }
        return {
            "file": self.file,
            "model_key": self.model_key,
            "layout": self.layout,
            "device": self.device,
            "records": self.records,
            "tasks": self.tasks,
            "failed": self.failed,
            "failure_kinds": self.failure_kinds,
            "truncated": self.truncated,
            "chunked": self.chunked,
            "windows": self.windows,
            "reused": self.reused,
            "repeats": self.repeats,
            "to_compute": self.tasks - self.reused - self.repeats,
            "real_tokens": self.real_tokens,
            "length_histogram": [{"tokens": r, "tasks": n} for r, n in self.length_histogram],
            "batches": self.batches,
            "padded_tokens": self.padded_tokens,
            "padding_fraction": round(self.padding_fraction, 5),
            "shapes": self.shapes,
            "predicted_seconds": round(self.prediction.seconds, 2) if self.prediction else None,
            "measured": measured,
        }


def preview_plan(
    db: Engine,
    path: Path,
    manifest: EngineManifest,
    *,
    truncate: bool = False,
    long_inputs: LongInputs | None = None,
    prompt: str = "",
    reuse: bool | None = None,
) -> PlanPreview:
    """Over-long items follow `long_inputs` (default: fail, or truncate if `truncate`); reuse as
    planning would (`reuse` None: FABRIC_REUSE)."""
    tokenizer = load_tokenizer(resolve_model_dir(manifest.model_id), prompt)
    tasks = ingest(
        path, tokenizer, max_seq_len=manifest.profile.max_seq_len, truncate=truncate,
        long_inputs=long_inputs,
    )  # fmt: skip
    lengths = tasks.lengths
    layout = input_layout(manifest)
    reused, repeats, rows = _reused(db, tasks, manifest, reuse)
    plan = plan_batches(
        lengths, manifest.profile.with_layout(layout), rows,
        keys=prefix_keys(tasks.tokens, tasks.offsets),
    )  # fmt: skip
    padded = int(plan.padded_tokens.sum())
    bins, counts = power_of_two_bins(lengths)
    return PlanPreview(
        file=str(path),
        model_key=manifest.model_key,
        layout=layout,
        device=engine_device(manifest),
        records=tasks.n_records,
        tasks=len(tasks.task_ids),
        failed=len(tasks.failures),
        failure_kinds=dict(Counter(_kind(f.reason) for f in tasks.failures).most_common()),
        truncated=tasks.truncated,
        chunked=tasks.n_chunked,
        windows=0 if tasks.windows is None else len(tasks.windows.document),
        reused=reused,
        repeats=repeats,
        real_tokens=int(lengths[rows].sum()),
        length_histogram=list(zip(bins, counts, strict=True)),
        batches=plan.n_batches,
        padded_tokens=padded,
        shapes=len(np.unique(plan.seq_len)),
        prediction=predict(db, manifest, layout, padded),
    )


def _reused(
    db: Engine, tasks: TokenisedTasks, manifest: EngineManifest, reuse: bool | None
) -> tuple[int, int, np.ndarray]:
    """(tasks with a stored result, repeats inside the file, the task rows left to compute)."""
    rows = np.arange(len(tasks.record_no), dtype=np.int64)
    if not reuse_enabled(reuse):  # as planning decides (lib/broker/reuse.py)
        return 0, 0, rows
    keys = content_keys(
        tasks.tokens, tasks.offsets, manifest.model_key, manifest.hooks.layers,
        engine=planned_identity(manifest),
    )  # fmt: skip
    eligible = tasks.record_no < WINDOW_BASE
    with db.connect() as conn:
        mid = conn.execute(select(Model.id).where(Model.model_key == manifest.model_key)).scalar()
        stored = (
            stored_keys(conn, mid, keys) & eligible
            if mid is not None
            else np.zeros(keys.size, dtype=bool)
        )
    left = rows[~stored]
    candidates = left[eligible[left]]
    _, first = np.unique(keys[candidates], return_index=True)
    is_first = np.zeros(candidates.size, dtype=bool)
    is_first[first] = True
    repeats = candidates[~is_first]
    return int(stored.sum()), int(repeats.size), np.setdiff1d(left, repeats)


def render_preview(preview: PlanPreview) -> str:
    p = preview
    lines = [
        f"{p.file}: {p.records:,} records -> {p.tasks:,} tasks, {p.failed:,} failed"
        + (f", {p.truncated:,} truncated" if p.truncated else "")
        + (f", {p.chunked:,} split into {p.windows:,} windows" if p.chunked else ""),
    ]
    for kind, n in p.failure_kinds.items():
        lines.append(f"  failed: {n:,} {kind}")
    if p.reused or p.repeats:
        lines.append(
            f"reused: {p.reused:,} tasks already have a stored result of {p.model_key}, "
            f"{p.repeats:,} repeat another task of the file; "
            f"{p.tasks - p.reused - p.repeats:,} to compute"
        )
    lines.append(f"tokens: {p.real_tokens:,} real to compute; tasks per length:")
    top = max((n for _, n in p.length_histogram), default=0)
    for tokens, n in p.length_histogram:
        bar = "#" * (round(40 * n / top) if top else 0)
        lines.append(f"  {tokens:>12} {n:>9,} {bar}")
    lines.append(
        f"batches: {p.batches:,} in {p.shapes} shapes ({p.layout}), {p.padded_tokens:,} padded "
        f"tokens, padding {100 * p.padding_fraction:.2f} %"
    )
    if p.prediction is None:
        lines.append(
            f"predicted engine time: no measurement yet of {p.model_key} on {p.device} "
            "(one run of it records its speed)"
        )
    else:
        m = p.prediction.measured
        lines.append(
            f"predicted engine time: {p.prediction.seconds:,.1f} s at "
            f"{p.prediction.padded_tokens_per_second:,.0f} padded tokens/s ({m.source}, "
            f"{m.measured_at:%Y-%m-%d %H:%M}, {p.device}; warm-up not included)"
        )
    return "\n".join(lines)


def _kind(reason: str) -> str:
    """A failure reason without where it was and the record's own details: what kind it is."""
    text = reason.split(": ", 1)[1] if reason.startswith(("line ", "row ")) else reason
    for kind in (
        "over-long",
        "empty text",
        "only whitespace",
        "duplicate id",
        "outside the vocabulary",
    ):
        if kind in text:
            return kind
    return text.split(";")[0].split(" (")[0][:60]
