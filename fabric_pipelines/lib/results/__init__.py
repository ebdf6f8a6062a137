"""What a worker stores and readers read back: the result writer, hidden-state files, combined long documents, export; imports core, store, tasks, records, broker."""
