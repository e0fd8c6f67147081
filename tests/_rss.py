"""Resident memory of this process, for the scripts that measure a peak's growth."""

import resource


def peak() -> int:
    """The process's peak resident set size so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current() -> int:
    """The process's resident set size now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
