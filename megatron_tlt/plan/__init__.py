"""`tlt plan`: the per-GPU memory estimate and the layout search."""
