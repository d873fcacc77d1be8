"""The agent protocols Turnstile serves beside Chat Completions: Anthropic Messages and
OpenAI Responses, each translated to and from the backend's Chat Completions so that
every call is recorded as one chat turn with the backend's exact token ids."""
