"""Checkpoint managers for local (node-level) checkpoints."""
