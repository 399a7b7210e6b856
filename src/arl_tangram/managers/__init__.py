"""Mechanisms that carry the engine's decisions out: sandboxes (CPU), model services (GPU), quotas."""
