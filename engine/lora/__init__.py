"""engine.lora: LoRA adapters: reading, the device cache of slots, the registry and the
kernels that apply them."""
