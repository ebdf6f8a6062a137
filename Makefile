# The two commands of the README. Each sets itself up first (scripts/bootstrap is a no-op when
# nothing changed).
.PHONY: demo test bootstrap lint

export DAGSTER_HOME := $(CURDIR)/dagster_home
export HF_HUB_OFFLINE := 1

bootstrap:
	@scripts/bootstrap

# The main job on the embedded default: SQLite, CPU engine, the real all-MiniLM-L6-v2.
demo: bootstrap
	.venv/bin/fabric demo

# The test suite (PostgreSQL tests use FABRIC_TEST_POSTGRES_URL, default the local server), in
# parallel: one pytest-xdist worker per core, each with its own scratch databases and data roots;
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
test: bootstrap
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

lint: bootstrap
	.venv/bin/ruff check fabric_gpu fabric_pipelines tests bench
	.venv/bin/ruff format --check fabric_gpu fabric_pipelines tests bench
	.venv/bin/mypy
	scripts/stubs --check
