"""What a run reports: the metrics path (console, metrics.jsonl, W&B) and the optimizer diagnostics."""
