"""The training loop and the components it is handed: data, precision, counters, checkpoints, run records."""
