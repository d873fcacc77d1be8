"""Development tooling: the embedded vLLM, the tiny model, caches, the drift corpus."""
