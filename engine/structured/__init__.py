"""engine.structured: constrained decoding (JSON schema, regex, grammar, choice): compiled
grammars, per-request matchers and the token mask the sampler applies."""
