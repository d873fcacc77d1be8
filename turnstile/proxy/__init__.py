"""The call: capture, sparse decoding, SSE relay, retries and rollout state."""
