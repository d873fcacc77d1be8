"""The `turnstile` command line, one module per command."""
