"""Facts measured and recorded beside the results: int8 calibrations, engine speeds, the
efficiency record, the stored-vector codec. Imports store and core."""
