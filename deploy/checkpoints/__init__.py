"""deploy.checkpoints: tools that write checkpoints (`pdserve make-model`, FP8 copies)."""
