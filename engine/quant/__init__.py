"""Low-bit weights for the CPU kernels: GGUF block formats, packed weights, routing, attaching to a model."""
