"""HF and Megatron weight, tokenizer and checkpoint formats."""
