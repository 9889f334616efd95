"""Step inputs packed for one host-to-device copy: values kept, every array 16-byte aligned."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pdd.engine.staging import ALIGN, Staging


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_each_array_starts_aligned_whatever_the_lengths_before_it(dtype):
    """Triton compiles a kernel once per pointer alignment: packed unaligned, a
    step whose arrays had other lengths compiled it again in service."""
    arrays = [np.arange(3), [], np.arange(5).reshape(1, 5), [7], np.arange(12).reshape(3, 4)]
    out = Staging(torch.device("cpu")).upload(arrays, dtype)
    base = out[0].data_ptr()
    for a, t in zip(arrays, out):
        assert t.dtype == dtype and t.shape == np.asarray(a).shape
        assert t.tolist() == np.asarray(a).tolist()
        assert (t.data_ptr() - base) % ALIGN == 0
