"""Every test in the repo gets the shared setup: the gpu marker and the seed fixture."""
pytest_plugins = ["grader.pytest_setup"]
