"""What an engine really did: each extraction run records the tokens its engine computed and
the seconds it took, per model, engine, layout and device (table engine_speeds), and a job's
time is predicted from the latest such record for the same engine; where there is none, there is
no prediction (never a guess)."""

from __future__ import annotations

import platform
from dataclasses import dataclass

from sqlalchemy import Engine, insert, select
from sqlalchemy.orm import Session

from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.store.keys import model_id, model_id_of
from fabric_pipelines.lib.store.models import EngineSpeed


@dataclass(frozen=True)
class Prediction:
    seconds: float
    padded_tokens_per_second: float
    measured: EngineSpeed  # the record it comes from


def engine_device(manifest: EngineManifest) -> str:
    """Where the manifest's engine runs here: the GPU's name, or the CPU's."""
    if manifest.backend == "cpu":
        return f"cpu ({platform.machine()}, {platform.processor() or 'unknown processor'})"
    from fabric_gpu.device import probe_gpu

    status = probe_gpu()
    return status.devices[0].name if status.available and status.devices else "no GPU"


@unit_of_work("recording the speed of the engine of {manifest.model_key}")
def record_speed(
    db: Engine,
    manifest: EngineManifest,
    layout: str,
    *,
    source: str,
    padded_tokens: int,
    real_tokens: int,
    seconds: float,
) -> None:
    if padded_tokens <= 0 or seconds <= 0:
        return  # nothing was computed: nothing measured
    with db.begin() as conn:
        conn.execute(
            insert(EngineSpeed),
            {
                "model_id": model_id(conn, manifest.model_key),
                "backend": manifest.backend,
                "layout": layout,
                "device": engine_device(manifest),
                "source": source[:256],
                "padded_tokens": padded_tokens,
                "real_tokens": real_tokens,
                "seconds": seconds,
            },
        )


def predict(
    db: Engine, manifest: EngineManifest, layout: str, padded_tokens: int
) -> Prediction | None:
    """Seconds to compute `padded_tokens` at this engine's latest measured rate, or None."""
    with Session(db, expire_on_commit=False) as session:
        measured = session.scalars(
            select(EngineSpeed)
            .where(
                EngineSpeed.model_id == model_id_of(manifest.model_key),
                EngineSpeed.backend == manifest.backend,
                EngineSpeed.layout == layout,
                EngineSpeed.device == engine_device(manifest),
            )
            .order_by(EngineSpeed.id.desc())
            .limit(1)
        ).first()
    if measured is None:
        return None
    rate = measured.padded_tokens / measured.seconds
    return Prediction(padded_tokens / rate, rate, measured)
