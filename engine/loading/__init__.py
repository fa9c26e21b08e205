"""engine.loading: checkpoints into models, one loader per weight format behind
`loaders.load_model` (bf16 safetensors, FP8 compressed-tensors, dummy weights), and FP8
calibration at load."""
