"""KV memory: the block pool, block tables and the radix prefix cache."""

from nanoserve.kv.block_pool import BlockPool, OutOfBlocksError
from nanoserve.kv.manager import BlockState, BlockTable, KVCacheManager, KVStats, PrefixCacheStats, blocks_needed
from nanoserve.kv.radix_cache import MatchResult, RadixCache

__all__ = ["BlockPool", "BlockState", "BlockTable", "KVCacheManager", "KVStats", "MatchResult", "OutOfBlocksError",
           "PrefixCacheStats", "RadixCache", "blocks_needed"]
