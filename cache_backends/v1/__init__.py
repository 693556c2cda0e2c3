"""KV cache manager V1: one pool of uniform blocks, and the no-evict scheduler that goes with it."""

from cache_backends.v1.manager import KVCacheManager, PrefixHit
from cache_backends.v1.scheduler import GuaranteedNoEvictScheduler

__all__ = ["GuaranteedNoEvictScheduler", "KVCacheManager", "PrefixHit"]
