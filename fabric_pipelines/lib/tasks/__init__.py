"""Task sets: reading submitted files, tokenising them, storing them as Arrow IPC."""
