"""The checkpoint pool: one face (``CheckpointPool``) over the index and the tiers."""

from statecache.pool.facade import CheckpointPool
from statecache.pool.offers import Offer
from statecache.pool.stats import Counts, PoolStats

__all__ = ["CheckpointPool", "Counts", "Offer", "PoolStats"]
