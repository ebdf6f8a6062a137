"""Per-run records kept beside the results: int8 calibrations, engine speeds, the efficiency record, stored-vector codecs; imports core, store."""
