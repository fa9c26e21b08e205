"""vocabulary: the torch-free types and helpers every process shares (worker API messages,
sampling params, block hashes, KV events, the tokenizer, model config, engine outputs and
errors, load and progress snapshots, tracing, waits); imports nothing of pdserve's."""
