"""One run's steps as the assets call them, without Dagster: the extraction step, its worker
sources, progress bars and the metadata the assets publish. The top floor of lib."""
