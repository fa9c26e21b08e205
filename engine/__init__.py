"""engine: the model execution core, in rooms (core loop, modeling, loading, kv, attention,
quantization, lora, tp); torch and the vocabulary only, never Ray, gRPC or Redis."""
