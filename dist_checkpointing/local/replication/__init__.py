"""Replication of local checkpoint parts across ranks (see `strategies`)."""

# `strategies` first: it re-exports `parity.ParityReplicationStrategy`, which builds on it
from . import strategies  # noqa: F401
