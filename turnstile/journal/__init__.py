"""The write-ahead journal: log, codec, start-up recovery and retention."""
