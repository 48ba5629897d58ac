"""KV caches behind one interface (:class:`KVCache`); the plain single-device cache."""

from writescope.kvcache.base import KVCache
from writescope.kvcache.contiguous import ContiguousKVCache

__all__ = ["KVCache", "ContiguousKVCache"]
