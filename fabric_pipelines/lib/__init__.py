"""Pure logic of the pipeline, testable without Dagster: task sets, broker, store, index."""
