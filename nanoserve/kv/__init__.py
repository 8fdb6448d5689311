"""KV memory: the block pool, block tables and the radix prefix cache."""

from nanoserve.kv.block_pool import BlockPool, OutOfBlocksError
from nanoserve.kv.manager import BlockTable, KVCacheManager, PrefixCacheStats
from nanoserve.kv.radix_cache import MatchResult, RadixCache

__all__ = ["BlockPool", "BlockTable", "KVCacheManager", "MatchResult", "OutOfBlocksError", "PrefixCacheStats",
           "RadixCache"]
