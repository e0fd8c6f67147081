"""Replication of local checkpoint parts across ranks (see `strategies`)."""
