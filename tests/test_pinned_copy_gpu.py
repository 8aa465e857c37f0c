"""Stage 10's copy_pinned (given code, pinned_copy.py): a kernel copies between pinned host
memory and the GPU; what it does not take goes to copy_. Equal to copy_ either way."""
from __future__ import annotations

import pytest
import torch

from course import parts


def _copy_pinned():
    return parts.reference("10", "pinned_copy").copy_pinned


def test_cpu_tensors_go_to_copy_():
    dst, src = torch.zeros(5, dtype=torch.int64), torch.arange(5)
    assert _copy_pinned()(dst, src) is dst
    assert dst.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("words", [1, 3, 255, 256, 257, 70_001])
def test_both_ways_equal_copy_(words):
    g = torch.Generator().manual_seed(words)
    host = torch.randint(-2**62, 2**62, (words,), generator=g).pin_memory()
    device = torch.full((words,), -1, dtype=torch.int64, device="cuda")
    _copy_pinned()(device, host)
    back = torch.full((words,), -1, dtype=torch.int64).pin_memory()
    _copy_pinned()(back, device)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), host), "host -> device"
    assert torch.equal(back, host), "device -> host"


@pytest.mark.gpu
def test_views_and_other_dtypes_equal_copy_():
    """A view that starts past a buffer's first word, and int32 data of whole 8-byte words."""
    host = torch.arange(40, dtype=torch.int32).pin_memory()
    device = torch.zeros(40, dtype=torch.int32, device="cuda")
    _copy_pinned()(device[6:], host[6:])
    torch.cuda.synchronize()
    assert device.tolist() == [0] * 6 + list(range(6, 40))


@pytest.mark.gpu
def test_what_the_kernel_does_not_take_goes_to_copy_():
    """An odd byte count, or a host tensor that is not pinned: copy_, same result."""
    odd = torch.arange(3, dtype=torch.int16)
    device = torch.zeros(3, dtype=torch.int16, device="cuda")
    _copy_pinned()(device, odd.pin_memory())
    unpinned = torch.arange(4)
    device64 = torch.zeros(4, dtype=torch.int64, device="cuda")
    _copy_pinned()(device64, unpinned)
    torch.cuda.synchronize()
    assert device.tolist() == [0, 1, 2] and device64.tolist() == [0, 1, 2, 3]


@pytest.mark.gpu
def test_the_op_refuses_memory_it_cannot_reach():
    op = parts.kernels().pinned_copy
    with pytest.raises(RuntimeError, match="pinned"):
        op(torch.zeros(4, dtype=torch.int64, device="cuda"), torch.arange(4))
    with pytest.raises(RuntimeError, match="8-byte words"):
        op(torch.zeros(3, dtype=torch.int16, device="cuda"), torch.arange(3, dtype=torch.int16).pin_memory())
    with pytest.raises(RuntimeError, match="must match"):
        op(torch.zeros(4, dtype=torch.int64, device="cuda"), torch.arange(5).pin_memory())
