"""The device facts the cluster and the workers size themselves by: how many CUDA devices this
process sees, and how much memory one of them has free.

The one module that asks torch about CUDA for them, so that tests replace these functions with
fakes (``monkeypatch.setattr(devices, "visible_gpu_count", lambda: 2)``) and exercise a GPU
host's defaults and sizing on a CPU. Callers look them up on the module at call time
(``devices.visible_gpu_count()``), never import them by name, so a replaced probe is the one
they call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def visible_gpu_count() -> int:
    """CUDA devices this process sees (``$CUDA_VISIBLE_DEVICES`` applies: a Ray replica sees
    the ones it was given); 0 without CUDA."""
    import torch  # here: the CLI (``nalar chat``, ``nalar bench``) reads defaults without it

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_available() -> bool:
    """Whether this process sees a CUDA device."""
    return visible_gpu_count() > 0


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, as the driver reports them (``cudaMemGetInfo``):
    free is what no process holds, this one's allocations (weights, the CUDA context)
    already taken out."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return free, total
