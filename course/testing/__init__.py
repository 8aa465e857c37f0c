"""The course's test helpers: what the stage tests, the project's tests, instructors' hidden
tests and the benchmarks' checks share.

    checks        seeded inputs, poisoned outputs, dtype tolerances, assertions that teach
    fixtures      tiny random Llama checkpoints in Hugging Face layout (transformers)
    equivalence   our forward pass and greedy tokens against transformers' on the same weights

Part of the course runtime, not of the grader: a stage's tests need the course, not the
machinery that runs and scores them.
"""
