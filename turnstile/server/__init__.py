"""The HTTP server: app assembly, lifecycle, workers, auth, metrics, logs and routes."""
