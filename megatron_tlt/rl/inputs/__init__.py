"""What a run reads: its task source (the tiny default or your model and data), prompts, sampler, policy."""
