"""The write-ahead journal: log, codec, the proxy's turn journal, start-up rebuild, retention."""
