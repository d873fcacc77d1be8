"""`python -m turnstile` runs the command line."""

from turnstile.cli import main

raise SystemExit(main())
