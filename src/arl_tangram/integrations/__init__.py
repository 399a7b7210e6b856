"""Adapters for RL frameworks."""
