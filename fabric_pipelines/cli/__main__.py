"""`python -m fabric_pipelines.cli`: the `fabric` command."""

from fabric_pipelines.cli import run_command

run_command()
