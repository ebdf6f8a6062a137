"""The steps' metadata (lib/steps/metadata.py) as Dagster shows it."""

from typing import Any

import dagster as dg

from fabric_pipelines.lib.steps.metadata import FilePath, Json, Markdown, Metadata, RunLink


def dagster_metadata(metadata: Metadata) -> dict[str, Any]:
    return {key: _value(value) for key, value in metadata.items()}


def _value(value: Any) -> Any:
    if isinstance(value, Markdown):
        return dg.MetadataValue.md(value.text)
    if isinstance(value, FilePath):
        return dg.MetadataValue.path(value.path)
    if isinstance(value, Json):
        return dg.MetadataValue.json(value.value)
    if isinstance(value, RunLink):
        return dg.MetadataValue.dagster_run(value.run_id)
    return value
