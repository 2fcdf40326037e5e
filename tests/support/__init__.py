"""What the tests and benchmarks share: GGUF writers, the model generator, llama.cpp as the oracle."""
