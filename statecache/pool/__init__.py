"""The checkpoint pool: one face (``CheckpointPool``) over the index and the tiers."""

from statecache.pool.facade import CheckpointPool, Offer

__all__ = ["CheckpointPool", "Offer"]
