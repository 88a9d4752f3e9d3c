"""Host-to-device copies that never stall the GPU stream.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory and then
synchronizes the stream: with overlapped scheduling that would wait for the step in
flight. These helpers stage through pinned memory and copy non-blocking; PyTorch's
pinned allocator keeps each staging buffer alive until its copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list of numbers as a tensor on ``device``, without a host sync."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def array_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array on ``device`` (shares memory on CPU)."""
    t = torch.from_numpy(a)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
