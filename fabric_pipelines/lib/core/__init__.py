"""Ground floor: the one file-writing helper, retries of transient database errors, names,
settings, charts and plots, alerts, preloading. Imports nothing else of lib."""
