"""tiny-vllm reference solutions: the finished engine the stages build up to."""
