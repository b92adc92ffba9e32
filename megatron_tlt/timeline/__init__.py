"""Per-rank BUSY / IDLE / TRAINING spans of a step, as a Chrome trace and as a PNG."""
