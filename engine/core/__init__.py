"""engine.core: the `LLMEngine` loop (schedule → run → postprocess), its requests, scheduler,
sampler, model runner, CUDA graphs, overlap scheduling and the thread that drives it."""
