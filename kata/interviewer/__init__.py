"""The interviewer's tools: the scorecard (`make review`: table, Markdown, JSON, --explain) and
the candidate's copy (`make handout`).

Depends on kata.harness and kata.toolchain, never on kata.candidate."""
