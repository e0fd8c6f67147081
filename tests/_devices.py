"""Device parameters shared by tests that run on the CPU and, where one exists, on CUDA."""

import pytest
import torch

#: the `cuda` case of a device parametrization: marked `gpu`, skipped without a CUDA device
CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)

#: parametrize a test's `device` argument with this to run it on the CPU and on CUDA
CPU_AND_CUDA = ["cpu", CUDA]
