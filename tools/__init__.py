"""Developer tools of the course (not used by the engine, the stages or the grader)."""
