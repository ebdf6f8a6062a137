"""The pipeline's logic, testable without Dagster, in subpackages stacked so every import points
down (bottom first): core, store | tasks, records | broker | index, results | worker, maintenance |
steps. Nothing here imports dagster, `cli`, `defs` or `definitions`; docs/architecture.md has the
table."""
