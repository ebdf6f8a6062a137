"""What extraction stores and readers read back: the write-behind result writer, hidden-state
files, combined long documents, export. Imports broker, tasks, records, store and core."""
