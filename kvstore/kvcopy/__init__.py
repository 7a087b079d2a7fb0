"""Moving KV bytes between arena pages and their consumers, engine-agnostic (no vLLM or
SGLang imports): copies that verify the bytes they move in the same pass."""
