"""The int8 calibration of a model key: measured once, recorded, and used by every run.

An engine with the `int8` output variant quantises each dimension over a range
(fabric_gpu/variants.py). All of a model key's vectors must share that range, or they are not
comparable. So the first run of the key measures it with the engine itself, on the float32
vectors of a sample of its set (its first CALIBRATION_ITEMS tasks), and records it
(`int8_calibrations`, migration 0012). Every later run and worker reads it back. Two runs that
calibrate at once both insert, ignoring a row already there, and then both read the one row
that won, so they quantise alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
from sqlalchemy import Connection, Engine, select

from fabric_gpu.batching import plan_batches
from fabric_gpu.engines.base import Engine as ExtractionEngine
from fabric_gpu.engines.base import PaddedBatch, gather_padded
from fabric_gpu.variants import Int8Calibration
from fabric_pipelines.lib.store.db import insert_ignoring_duplicates
from fabric_pipelines.lib.store.keys import model_id, model_id_of
from fabric_pipelines.lib.store.models import CalibrationRow

CALIBRATION_ITEMS = 512  # vectors the range is measured on


def recorded_calibration(conn: Connection, model_key: str) -> Int8Calibration | None:
    """The calibration recorded for `model_key`; None before its first int8 run."""
    text = conn.execute(
        select(CalibrationRow.calibration_json).where(
            CalibrationRow.model_id == model_id_of(model_key)
        )
    ).scalar_one_or_none()
    return Int8Calibration.from_json(text) if text is not None else None


def calibration_sha256(calibration: Int8Calibration) -> str:
    return hashlib.sha256(calibration.to_json().encode()).hexdigest()


def calibrate_engine(
    db: Engine,
    engine: ExtractionEngine,
    model_key: str,
    tokens: np.ndarray,
    offsets: np.ndarray,
    source: str,
    pad_token_id: int = 0,
) -> Int8Calibration | None:
    """Give an int8 engine its model key's calibration, measuring and recording it first where
    none is recorded; engines of other variants are left alone (None)."""
    variant = engine.manifest.hooks.output_variant()
    if not variant.needs_calibration():
        return None
    with db.connect() as conn:
        calibration = recorded_calibration(conn, model_key)
    if calibration is None:
        n = min(CALIBRATION_ITEMS, len(offsets) - 1)
        if n <= 0:
            raise ValueError(
                f"model {model_key}: int8 needs tasks to calibrate on; the set is empty"
            )
        sample = np.concatenate(
            [
                engine.forward(batch).pooled
                for batch in _batches(engine, tokens, offsets, n, pad_token_id)
            ]
        )
        measured = Int8Calibration.of(variant.prepared(sample))
        with db.begin() as conn:
            conn.execute(
                insert_ignoring_duplicates(db, CalibrationRow).values(
                    model_id=model_id(conn, model_key),
                    calibration_json=measured.to_json(),
                    sha256=calibration_sha256(measured),
                    n_vectors=n,
                    source=f"first {n} tasks of {source}"[:256],
                )
            )
        with db.connect() as conn:  # the row that won, if another run calibrated at once
            calibration = recorded_calibration(conn, model_key)
        assert calibration is not None
    engine.set_int8_calibration(calibration)
    return calibration


def _batches(
    engine: ExtractionEngine, tokens: np.ndarray, offsets: np.ndarray, n: int, pad_token_id: int
) -> Iterator[PaddedBatch]:
    """Tasks 0..n-1 as the planner's shape-pure padded batches within the engine's limits (the
    range does not depend on how they are batched)."""
    plan = plan_batches(np.diff(offsets[: n + 1]), engine.profile.with_layout("padded"))
    for b in range(plan.n_batches):
        rows = plan.order[plan.item_start[b] : plan.item_start[b] + plan.item_count[b]]
        yield gather_padded(tokens, offsets, rows, int(plan.seq_len[b]), pad_token_id)
