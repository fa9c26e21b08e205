"""engine: model, paged KV block pool, scheduler, sampler, runner and the `LLMEngine` loop
(torch only; see docs/structure.md)."""
