"""The web viewer of `turnstile view` (and the data layer `turnstile inspect` shares)."""
