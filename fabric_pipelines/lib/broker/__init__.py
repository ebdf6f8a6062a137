"""The broker: shape-bucketed batch plans, the batch ledger (leases, acks, accounting), claims
ahead, reuse by content and `fabric plan`'s preview. Imports tasks, records, store and core."""
