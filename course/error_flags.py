"""The int32 flag a kernel sets when it meets a bad input (an id outside the vocabulary, a
position outside the rope table): it cannot raise, so its op reads the flag after the launch.

A checked call gets a new zeroed flag and reads it (one host synchronization). An unchecked
call (check=False: inside a CUDA graph, or where the caller validated its inputs once) shares
one flag per device that nobody reads, so it launches its kernel alone, not also a kernel that
zeroes a new flag: in a decode graph that zeroing was one more kernel in every step.
"""
from __future__ import annotations

import torch

_unread: dict[torch.device, torch.Tensor] = {}


def error_flag(device: torch.device, check: bool) -> torch.Tensor:
    """A zeroed [1] int32 flag on `device` for a checked call; the device's unread one otherwise."""
    if check:
        return torch.zeros(1, dtype=torch.int32, device=device)
    flag = _unread.get(device)
    if flag is None:
        flag = _unread[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag
