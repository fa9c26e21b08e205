"""engine.quantization: quantized linear layers and their kernels (FP8)."""
