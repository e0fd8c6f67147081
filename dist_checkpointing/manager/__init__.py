"""The checkpoint manager: when to save, how many to keep, which one to load."""
