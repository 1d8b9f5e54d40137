"""Dynamic batching (after Triton's dynamic batcher)."""

from carpool.batching.batcher import BatchModel, DynamicBatcher

__all__ = ["BatchModel", "DynamicBatcher"]
