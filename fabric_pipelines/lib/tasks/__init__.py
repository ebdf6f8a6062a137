"""Task sets: reading submitted files, tokenising them, storing them as Arrow IPC files, the inbox
and the catalog of sets. Imports store and core."""
