"""GPU benchmarks. `python3 -m bench` (nox -s bench) is the one command: this engine beside
transformers on the same weights, every workload, the kernel table and the decode-step
profile, results to JSON (docs/benchmarks.md). Its parts also run alone: `python3 -m
bench.kernels`, `bench.throughput`, `bench.profile`, `bench.engine`; `python3 -m bench.plot`
draws a result's PNGs anywhere, `python3 -m bench.report` prints its tables again. Each needs
a CUDA device (the plot and the report do not) and says so plainly, measuring nothing, when
there is none."""
