"""`python -m turnstile` runs the command line."""

from turnstile.cli.main import main

raise SystemExit(main())
