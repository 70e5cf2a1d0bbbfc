"""Data for data-parallel ranks: which examples each rank reads (``DistributedSampler``'s split over a mesh)."""

from funcshard._src.data.sampler import shard_indices as shard_indices

__all__ = ["shard_indices"]
