"""One dynamic partition per task set; the inbox sensor and `fabric submit` add them."""

import dagster as dg

TASK_SET_PARTITIONS = "task_set"
task_sets = dg.DynamicPartitionsDefinition(name=TASK_SET_PARTITIONS)
