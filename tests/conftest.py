"""Shared fixtures: data roots, the two databases, the real model's manifest and engine.

PostgreSQL tests run against the server named by FABRIC_TEST_POSTGRES_URL (default: the local
server, user postgres, database test). Each test session creates its own scratch database there
and drops it at the end. Where CI=true an unreachable server fails the run instead of skipping.

Database and model packages are imported inside the fixtures that need them, so the runtime's
tests also run on a GPU machine that has only fabric_gpu's own dependencies.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.core.signals import stop_on_signals


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`), the tests of pgserver's throw-away PostgreSQL run on one
    worker (--dist loadgroup): two such servers started by two workers at once did not both
    answer."""
    for item in items:
        if "pgvector_server_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("pgvector"))


POSTGRES_FIXTURES = {"postgres_server_url", "own_postgres_database"}


@pytest.fixture(autouse=True)
def _postgres_server_turns(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """The tests on the local PostgreSQL server share it across the xdist workers; the one test
    that restarts it (marked `restarts_postgres`) must not cut the others' connections: it holds
    the server alone (an exclusive flock on a file all the workers see), the others share it."""
    import fcntl

    exclusive = request.node.get_closest_marker("restarts_postgres") is not None
    uses = request.node.get_closest_marker("postgres") is not None or bool(
        POSTGRES_FIXTURES & set(request.fixturenames)
    )
    if not (exclusive or uses):
        yield
        return
    # The parent of this worker's base temp folder is the whole run's (all workers').
    path = tmp_path_factory.getbasetemp().parent / "postgres-server.lock"
    with open(path, "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


def pytest_configure(config: pytest.Config) -> None:
    """The suite does not depend on the signal dispositions it inherited: started in the
    background with SIGINT ignored (`nohup make test &`), Dagster would copy that onto SIGTERM
    and every child a test starts would ignore `terminate()`, hanging the test that waits."""
    stop_on_signals()


if TYPE_CHECKING:
    from sqlalchemy import Engine

    from fabric_gpu.manifest import EngineManifest
    from fabric_pipelines.lib.core.settings import FabricPaths

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Runs use their own workers unless a test turns the warm engine pool on: a pool worker outlives
# its run (test_engine_pool.py covers the pool, and stops what it starts).
os.environ.setdefault("FABRIC_POOL_IDLE_SECONDS", "0")

POSTGRES_ADMIN_URL = os.environ.get(
    "FABRIC_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture
def paths(tmp_path: Path) -> FabricPaths:
    from fabric_pipelines.lib.core.settings import FabricPaths

    return FabricPaths(tmp_path / "fabric").ensure()


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """URL of a scratch database on the PostgreSQL server, for the whole session."""
    from sqlalchemy import create_engine, text

    from fabric_pipelines.lib.core.retry import retry

    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")

    def probe() -> None:
        with admin.connect() as conn:
            conn.execute(text("select 1"))

    try:
        # A few seconds' grace: the server may be restarting (a test restarts it).
        retry("reaching the test PostgreSQL server", probe, budget_s=20 if IN_CI else 3)
    except Exception as exc:
        if IN_CI:
            pytest.fail(f"PostgreSQL at {POSTGRES_ADMIN_URL} is required in CI: {exc}")
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_ADMIN_URL}: {exc}")
    finally:
        admin.dispose()
    from fabric_testing.scratch_db import scratch_database

    with scratch_database(POSTGRES_ADMIN_URL, "fabric_test") as url:
        yield url


@pytest.fixture(scope="session")
def pgvector_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throw-away PostgreSQL server that has pgvector, for the pgvector storage path.

    The local server (Debian's PostgreSQL 15) has no pgvector package in the reachable
    registries, so this runs the PostgreSQL 16 + pgvector build of the `pgserver` wheel (a real
    server, on a Unix socket in a temporary folder), stopped and deleted at the end."""
    try:
        import pgserver
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"pgserver (a test dependency) is required in CI: {exc}")
        pytest.skip(f"pgserver is not installed: {exc}")
    server = pgserver.get_server(
        tmp_path_factory.mktemp("pgvector") / "data", cleanup_mode="delete"
    )
    socket_dir = server.get_uri().split("host=", 1)[1]
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={socket_dir}"
    finally:
        server.cleanup()


@pytest.fixture
def own_postgres_database(postgres_server_url: str) -> Iterator[str]:
    """URL of a database of its own, for a test whose tenant (e.g. Dagster's instance storage)
    keeps its own Alembic history and must not meet the product's tables."""
    from fabric_testing.scratch_db import scratch_database

    with scratch_database(POSTGRES_ADMIN_URL, "fabric_own") as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, paths: FabricPaths) -> Iterator[str]:
    """Each test using this runs twice: on a fresh SQLite file and on a fresh PostgreSQL schema."""
    from fabric_pipelines.lib.store.db import make_engine
    from fabric_testing.scratch_db import empty_public_schema

    if request.param == "sqlite":
        yield f"sqlite:///{paths.sqlite_path}"
        return
    url = request.getfixturevalue("postgres_server_url")
    engine = make_engine(url)
    empty_public_schema(engine)  # every test starts from no schema at all
    engine.dispose()
    yield url


@pytest.fixture
def db(db_url: str) -> Iterator[Engine]:
    from fabric_pipelines.lib.store.db import create_schema, make_engine

    engine = make_engine(db_url)
    create_schema(engine)
    yield engine
    engine.dispose()


TEST_PROFILE = ConsumerProfile(
    max_batch_tokens=4096, max_batch_items=64, max_seq_len=128, seq_granularity=8
)


@pytest.fixture(scope="session")
def manifest() -> EngineManifest:
    """The real all-MiniLM-L6-v2 on the CPU engine, with two hook layers; its pooled vectors
    are the plain means (not normalised, which its folder would choose), so tests can compare
    them with the model's own outputs."""
    from fabric_gpu.manifest import HookSpec, manifest_for_model
    from fabric_gpu.model import DEFAULT_MODEL_ID

    return manifest_for_model(
        DEFAULT_MODEL_ID,
        backend="cpu",
        dtype="float32",
        profile=TEST_PROFILE,
        hooks=HookSpec((2, -1), "mean", normalize=False),
    )


@pytest.fixture(scope="session")
def cpu_engine(manifest: EngineManifest) -> Iterator[Any]:
    from fabric_gpu.engines import create_engine

    engine = create_engine(manifest)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random BERT with the real MiniLM tokenizer: real engine code, fast forwards.
    FABRIC_MINILM_TOKENIZER: a folder holding that tokenizer's files, used instead of the
    model package's."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=512,
    )  # fmt: skip
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    # A folder of the real tokenizer's files stands in where the model package is not installed
    # (the GPU machine: its weights are too large to carry there).
    tokenizer = os.environ.get("FABRIC_MINILM_TOKENIZER")
    source = Path(tokenizer) if tokenizer else resolve_model_dir(DEFAULT_MODEL_ID)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)
    return folder


# What a skipped test needed, matched on its skip reason: the summary names the real parts this
# run did without and the one command that brings each in.
REAL_PARTS = (
    ("chromium", "the UI test (real `dagster dev`, headless chromium)",
     "apt-get install -y chromium, then the same command"),
    ("PostgreSQL not reachable", "the PostgreSQL tests",
     "start PostgreSQL on 127.0.0.1:5432 (user postgres, database test; or set "
     "FABRIC_TEST_POSTGRES_URL), then the same command"),
    ("pgserver is not installed", "the pgvector tests (pgserver's PostgreSQL)",
     "scripts/bootstrap (installs the test extras, pgserver among them)"),
    ("GPU", "the GPU tests", "on a machine with an NVIDIA GPU: pytest -m gpu"),
    ("CUDA", "the GPU tests", "on a machine with an NVIDIA GPU: pytest -m gpu"),
    ("all-MiniLM-L6-v2 is not available", "the real-model GPU check",
     "FABRIC_MINILM_DIR=<the model folder> pytest -m gpu"),
)  # fmt: skip


def real_parts_skipped(reasons: list[str]) -> dict[str, tuple[int, str]]:
    """What each skip reason says was missing: {real part: (tests skipped, the command)}."""
    found: dict[str, tuple[int, str]] = {}
    for reason in reasons:
        for needle, part, command in REAL_PARTS:
            if needle in reason:
                count, _ = found.get(part, (0, command))
                found[part] = (count + 1, command)
                break
    return found


def pytest_unconfigure(config: pytest.Config) -> None:
    """After pytest's own summary line, so the run ends with it: the real parts the run did
    without, and the one command that brings each in."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    reasons = []
    for report in reporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            reasons.append(str(longrepr[2]))
    found = real_parts_skipped(reasons)
    if not found:
        return
    reporter.write_sep("=", "real parts this run did without")
    for part, (count, command) in found.items():
        reporter.write_line(f"{part}: {count} test(s) skipped; to run them: {command}")
