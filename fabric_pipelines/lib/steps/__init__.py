"""One run's steps without Dagster: the extraction step, its worker sources, progress and the metadata the assets publish; the top floor of lib."""
