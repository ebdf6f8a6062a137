"""Vector indexes: FAISS builds, their quality, and the receipts that reproduce them. Imports
broker, tasks, records, store and core. This `__init__` stays light (no torch, no FAISS)."""

# What the index step imports (torch and FAISS: seconds); a step that waits on its workers
# preloads these meanwhile (`core.preload`).
INDEX_MODULES = (f"{__name__}.publish",)
