"""The judge, shared by the interviewer's and the candidate's tools: the flaw catalogs, one probe
per flaw, the processes they run in (the runner, the sandbox) and the review of all of them.

Depends on kata.toolchain (to build what it judges), never on kata.interviewer or
kata.candidate."""
