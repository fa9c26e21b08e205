"""engine.modeling: the Llama-family model and the fused layer ops it runs on."""
