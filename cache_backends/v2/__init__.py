"""KV cache manager V2 and its scheduler: per-group pools, prefix reuse, host tier, suspend/resume."""

from cache_backends.v2.manager import KVCacheManagerV2
from cache_backends.v2.scheduler import KVCacheV2Scheduler
from cache_backends.v2.sequence import CacheState, SequenceCache

__all__ = ["CacheState", "KVCacheManagerV2", "KVCacheV2Scheduler", "SequenceCache"]
