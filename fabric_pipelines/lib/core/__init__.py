"""Ground floor: files written through one helper, retries, names, settings, charts and plots; imports nothing else of lib."""
