"""Page-locking host buffers in place, so device-to-host copies into them run asynchronously.

`pin` registers an existing buffer with the CUDA driver (the buffer stays ours: shared
memory stays shared); `unpin` must be called before the buffer's memory is freed. Both are
no-ops returning False on machines without CUDA, so CPU runs take the same code path.
"""

from __future__ import annotations

import ctypes
import logging

import torch

__all__ = ["pin", "unpin"]

logger = logging.getLogger(__name__)


def _ok(err: object) -> bool:
    code = err[0] if isinstance(err, tuple) else err
    return int(code) == 0  # type: ignore[arg-type]


def pin(buf: torch.Tensor) -> bool:
    """Page-locks the host memory of `buf` (contiguous, on the CPU).

    Returns:
        Whether the buffer is now pinned. False without CUDA, or where the driver refuses
        (logged; copies into the buffer are then synchronous, still correct).
    """
    if not torch.cuda.is_available():
        return False
    nbytes = buf.numel() * buf.element_size()
    try:
        ok = _ok(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
    except Exception as e:  # a build without cudart bindings
        logger.warning("could not pin a %d-byte staging buffer (%s)", nbytes, e)
        return False
    if not ok:
        # the failed call left CUDA's per-thread "last error" set: the next kernel launch of
        # the training step would raise it as its own failure
        _clear_last_cuda_error()
        logger.warning("could not pin a %d-byte staging buffer; copies will be synchronous", nbytes)
    return ok


def _clear_last_cuda_error() -> None:
    """Resets CUDA's last error through the runtime library torch loaded (best effort).

    torch exposes no binding for `cudaGetLastError`; the library is found among the
    process's mappings, so the call reaches the runtime instance torch itself uses.
    """
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "libcudart" in line}
        for lib in libs:
            ctypes.CDLL(lib).cudaGetLastError()
    except Exception as e:  # no /proc, or a static runtime: nothing we can reset
        logger.debug("could not reset CUDA's last error: %s", e)


def unpin(buf: torch.Tensor) -> None:
    """Undoes `pin` (call while `buf`'s memory is still alive)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    except Exception as e:
        logger.debug("cudaHostUnregister failed: %s", e)
