"""Small helpers over torch.distributed that also work in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_cat(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equally-shaped tensors from every rank along dim 0 (rank order)."""
    _, world = rank_and_world()
    if world == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def all_reduce_mean(values: dict[str, float]) -> dict[str, float]:
    """Average a dict of host floats over ranks (for logging)."""
    _, world = rank_and_world()
    if world == 1 or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: v / world for k, v in zip(keys, t.tolist())}
