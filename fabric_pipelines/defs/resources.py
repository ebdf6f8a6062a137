"""Typed resources: where files live, which database, which engine."""

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr
from sqlalchemy import Engine

from fabric_gpu.engines import Engine as ExtractionEngine
from fabric_gpu.engines import create_engine
from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
from fabric_gpu.model_defaults import model_defaults
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import DEFAULT_LEASE_SECONDS
from fabric_pipelines.lib.core.settings import FabricPaths, database_url, default_root, redact_url
from fabric_pipelines.lib.steps.extraction import WorkerOptions
from fabric_pipelines.lib.steps.run_extraction import DEFAULT_MAX_RESTARTS
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.tasks.windows import (
    DEFAULT_MODE,
    DEFAULT_OVERLAP,
    LongInputs,
    long_input_policy,
)
from fabric_pipelines.lib.worker.devices import lease_devices, visible_gpus
from fabric_pipelines.lib.worker.pool.client import idle_seconds_setting
from fabric_pipelines.lib.worker.prestart import prestarted_devices


class ArtifactStore(dg.ConfigurableResource):
    """The data root: inbox, task sets, plans, shards, indexes, receipts (default DAGSTER_HOME)."""

    root: str = ""

    def paths(self) -> FabricPaths:
        root = Path(self.root).expanduser().resolve() if self.root else default_root()
        return FabricPaths(root).ensure()


class Database(dg.ConfigurableResource):
    """The results database: `url`, else FABRIC_DATABASE_URL, else SQLite under the data root."""

    store: ArtifactStore
    url: str = ""
    _engine: Engine | None = PrivateAttr(default=None)

    def resolved_url(self) -> str:
        return database_url(self.store.paths(), self.url or None)

    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = make_engine(self.resolved_url())
            create_schema(self._engine)
        return self._engine

    def describe(self) -> str:
        return redact_url(self.resolved_url())


class EngineConfig(dg.ConfigurableResource):
    """The extraction engine: a manifest file (FABRIC_ENGINE_MANIFEST), or these fields."""

    manifest_path: str = ""
    backend: str = "cpu"
    model_id: str = DEFAULT_MODEL_ID
    dtype: str = "float32"
    max_batch_tokens: int = 8192
    max_batch_items: int = 256
    # None: the model folder's own (fabric_gpu/model_defaults.py): all-MiniLM-L6-v2's
    # sentence-transformers config says 256 tokens, mean pooling, normalised vectors.
    max_seq_len: int | None = None
    seq_granularity: int = 8
    # Layers whose hidden states are kept in shard files; none by default (pooled embedding
    # only): shards are large, so they are written only when asked for.
    hook_layers: list[int] = Field(default_factory=list)
    pooling: str | None = None
    normalize: bool | None = None
    # The encoding the engine stores its pooled vectors in (fabric_gpu/variants.py), made on
    # the GPU before the copy to the host: float32 (default), float16, int8 or binary, each
    # optionally shortened to its first N dimensions (e.g. "int8:256"). It is part of the model
    # key: each variant's results are kept apart.
    variant: str = "float32"
    # Tasks whose content key (token ids, model key, hook layers) already has a stored result,
    # in any task set, get a copy of it instead of a place in a batch (lib/broker/reuse.py). None:
    # FABRIC_REUSE (on unless "off"); False: every task is computed.
    reuse_results: bool | None = None
    # Items longer than max_seq_len (lib/tasks/windows.py): "chunk" into windows of the model's
    # length overlapping by window_overlap tokens, one vector per document from them; "truncate"
    # to it, as sentence-transformers' encode() does (counted); or "fail" with the reason.
    long_inputs: str = DEFAULT_MODE
    window_overlap: int = DEFAULT_OVERLAP
    # The earlier spelling: True is long_inputs "truncate", False "fail"; None: long_inputs.
    truncate: bool | None = None

    def long_input_policy(self) -> LongInputs:
        return long_input_policy(self.long_inputs, self.window_overlap, self.truncate)

    # Worker processes pulling batches from the ledger (0: run in the Dagster step's process).
    # GPU engines: at most one per GPU; each gets its own device.
    workers: int = 1
    # A worker's claim on a batch lasts lease_seconds unless its heartbeat renews it (every
    # heartbeat_seconds; None: a third of the lease): a dead worker's batch runs again after at
    # most one lease, however long live workers' batches take.
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    heartbeat_seconds: float | None = None
    # Workers started in place of ones that died or were lost (silent for a lease), for the
    # whole step; the step fails only when no worker is left and work remains.
    max_worker_restarts: int = DEFAULT_MAX_RESTARTS
    # Where the workers run: "local", processes of this host (the default); "kubernetes", a pod
    # per worker through dagster-k8s's PipesK8sClient, set up by `worker_pods` (a file like
    # deploy/k8s/workers.yaml, the default; PostgreSQL required); "pipes-subprocess", this
    # host's processes through Dagster's PipesSubprocessClient, the pods' seam on one host.
    # A deployment sets them with FABRIC_WORKER_LAUNCHER and FABRIC_WORKER_PODS.
    launcher: str = "local"
    worker_pods: str = ""
    # The warm engine pool (lib/worker/pool/client.py): worker processes that keep the model loaded
    # for this long after their last job, for the next run. None: FABRIC_POOL_IDLE_SECONDS,
    # else 300 s; 0: no pool (each run starts its own workers).
    pool_idle_seconds: float | None = None

    def pool_idle(self) -> float:
        return idle_seconds_setting(self.pool_idle_seconds)

    def worker_options(self, database_url: str) -> WorkerOptions:
        return WorkerOptions(
            database_url=database_url,
            workers=self.workers,
            lease_seconds=self.lease_seconds,
            heartbeat_seconds=self.heartbeat_seconds,
            pool_idle_seconds=self.pool_idle(),
            max_restarts=self.max_worker_restarts,
        )

    @contextmanager
    def devices(
        self, paths: FabricPaths, on_wait: Callable[[], None], task_set: str = ""
    ) -> Iterator[list[int] | None]:
        """GPU per worker for GPU backends (worker i -> the i-th leased device), held for the
        block so concurrent steps never share a GPU; None for the CPU engine, in-process runs
        and workers of other hosts (a pod asks its scheduler for its GPU).
        Workers started early for `task_set` (lib/worker/prestart.py) hold theirs already."""
        if self.manifest().backend == "cpu" or self.workers == 0 or self.launcher == "kubernetes":
            yield None
            return
        held = prestarted_devices(task_set)
        if held is not None:
            yield held
            return
        with lease_devices(
            paths.device_leases, self.workers, visible_gpus(), on_wait=on_wait
        ) as leased:
            yield leased

    def manifest(self) -> EngineManifest:
        if self.manifest_path:
            return EngineManifest.load(Path(self.manifest_path))
        defaults = model_defaults(resolve_model_dir(self.model_id))
        return manifest_for_model(
            self.model_id,
            backend=self.backend,
            dtype=self.dtype,
            profile=ConsumerProfile(
                max_batch_tokens=self.max_batch_tokens,
                max_batch_items=self.max_batch_items,
                max_seq_len=self.max_seq_len or defaults.max_seq_len,
                seq_granularity=self.seq_granularity,
            ),
            hooks=HookSpec(
                tuple(self.hook_layers),
                self.pooling or defaults.default_pooling(),
                defaults.normalize if self.normalize is None else self.normalize,
                self.variant,
            ),
        )

    def create(self, manifest: EngineManifest) -> ExtractionEngine:
        return create_engine(manifest)


def _from_environment(name: str) -> Any:
    """Dagster's EnvVar for `name` where it is set (the UI then shows where the setting came
    from), else "": the resource's default."""
    return dg.EnvVar(name) if os.environ.get(name) else ""


@dg.definitions
def resources() -> dg.Definitions:
    store = ArtifactStore(root=_from_environment("FABRIC_HOME"))
    return dg.Definitions(
        resources={
            "store": store,
            "database": Database(store=store, url=_from_environment("FABRIC_DATABASE_URL")),
            "engine": EngineConfig(
                manifest_path=_from_environment("FABRIC_ENGINE_MANIFEST"),
                launcher=_from_environment("FABRIC_WORKER_LAUNCHER") or "local",
                worker_pods=_from_environment("FABRIC_WORKER_PODS"),
            ),
        }
    )
