"""The broker: shape-bucketed batch planning and the batch ledger."""
