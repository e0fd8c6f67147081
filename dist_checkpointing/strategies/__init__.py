"""Strategies: the registry (`base`) and the built-in backends ('torch_dist', 'torch').

Importing this package registers nothing; built-ins register on the registry's first use.
"""
