"""Loaded first by every Python process whose PYTHONPATH starts with this folder (the runs of
tests/test_phase_faults.py and bench/faults.py): the database faults of fabric_testing/db_faults.py."""

import os

if os.environ.get("FABRIC_FAULT_UNITS") or os.environ.get("FABRIC_FAULT_UNCOVERED"):
    from fabric_testing.db_faults import install

    install()
