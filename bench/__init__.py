"""GPU benchmarks: `python3 -m bench.kernels` (each kernel beside its torch twin) and
`python3 -m bench.engine` (greedy generation beside transformers). Both need a CUDA device
and say so plainly, measuring nothing, when there is none."""
