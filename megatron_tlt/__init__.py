"""megatron-tlt: Megatron-Core RL trainer for reasoning LLMs with TLT (adaptive drafter + adaptive speculative rollouts)."""

__version__ = "0.1.0"
