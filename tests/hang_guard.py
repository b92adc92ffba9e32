"""The limit on every subprocess a test starts: a hang guard only, never a measure (no test asserts how long a run
takes). Importable as ``hang_guard``: pytest puts tests/ on the path for its conftest."""

# Under pytest.ini's `timeout = 900` a test, so that a hung `tlt` run or script is killed by subprocess's own limit
# and the test fails with its captured output (TimeoutExpired), with 60 s left to report it, instead of
# pytest-timeout ending the whole test with a stack dump of the waiting parent.
HANG_GUARD_S = 840
