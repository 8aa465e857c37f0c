"""The tiny-vllm engine: model loading, scheduling and generation built on the stage parts."""
