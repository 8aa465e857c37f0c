"""The course runtime: the manifest, the parts resolver, the kernel builder, the op table and
the test helpers (course.testing).

The engine (solutions/), the stage parts and tests, the benchmarks and the grader all use it;
it imports none of them, so the engine runs without the grader.
"""
