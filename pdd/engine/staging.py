"""Host arrays to device tensors without making the host wait for the GPU.

A copy from pageable host memory may synchronize with the stream (the CUDA
driver stages it through pinned memory), which would stall async scheduling:
the host, preparing step N+1, would wait for step N. So each step's inputs of
one dtype are packed into one pinned buffer and cross in one non-blocking copy.
The buffer comes from torch's caching host allocator, which does not hand it
out again before that copy has completed.
"""
from __future__ import annotations

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"

    def upload(self, arrays: list, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each array (numpy or list; any shape) as a tensor of `dtype` on the device."""
        arrays = [np.asarray(a) for a in arrays]
        sizes = [a.size for a in arrays]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=self.pinned)
        flat = host.numpy()
        offset = 0
        for a, n in zip(arrays, sizes):
            flat[offset:offset + n] = a.reshape(-1)
            offset += n
        dev = host.to(self.device, non_blocking=True) if self.pinned else host
        out, offset = [], 0
        for a, n in zip(arrays, sizes):
            out.append(dev[offset:offset + n].view(a.shape))
            offset += n
        return out
