"""Installing and building, for every role: `make deps` (deps.py); the vendor library, the
fixed/ extension and the nvcc compile check (builders.py); flawed/ as shipped (shipped.py), the
source of `make reset`, of the candidate's diff and of the reference kernel.

Depends on nothing else of kata/ (tests/test_layout.py holds every package to its place)."""
