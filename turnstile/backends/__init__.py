"""The backend seam: the protocol, its HTTP client, the pool, the SGLang adapter."""
