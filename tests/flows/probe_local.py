"""The probe deployment's own module (tests/test_forked_runs.py edits it between runs)."""

LOCAL_VERSION = 1
