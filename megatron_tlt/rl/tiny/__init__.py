"""The tiny default: its long-tail task, tokenizer and policy shape, warm-up, and shipped start."""
