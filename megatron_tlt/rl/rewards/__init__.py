"""Rewards: the functions, their Ray actor pool beside the rollout, and the Ray cluster."""
