"""The candidate's tools: `make kata` (check), `make watch`, `python -m kata hint` and
`make reset`.

Depends on kata.harness and kata.toolchain, never on kata.interviewer."""
