"""The Megatron policy: its architecture, layer spec, build, checkpoints and forward."""
