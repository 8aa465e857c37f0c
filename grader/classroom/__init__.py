"""Class grading for a class that may be hostile (DESIGN principle 10).

    cli.py          `python3 -m grader class SUBMISSIONS ...`: the loop, progress, resume
    submission.py   submissions are data: validation, fresh per-student workspaces
    sandbox.py      bubblewrap (or the documented fallback), resource limits
    collect.py      the trusted test list and points, from the course's tests
    grade.py        one student's stage: compile check, judged tests, GPU tests, score
    gpu.py          the GPU tests under watch: limits per test and student, fresh processes
    judge.py        pytest plugin: tests run here, student parts are proxies to...
    harness.py      ...the worker, the sandboxed process that holds the student's code
    protocol.py     the wire between them (replies decoded without resolving any global)
    snapshot.py     plain attributes that travel with a reply: reads without a round trip
    shards.py       `--shard I/N`: who is graded where; what merge checks
    merge.py        `python3 -m grader merge SHARD...`: one class's reports from its shards
    reports.py      CSV, JSON, JUnit and similarity reports, from the grades alone
    autograde.py    a student's repository graded for GitHub Classroom's reporter
    templates/      Slurm, GitHub Actions and GitHub Classroom templates to copy
    similarity.py   shared lines with the reference and between classmates
    text.py         XML-safe, byte-capped text for reports

docs/instructors.md says what is guarded against and what is not.
"""
