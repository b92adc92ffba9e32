"""A run's files: summary, progress, checkpoints, loggers, step records, cached artifacts."""
