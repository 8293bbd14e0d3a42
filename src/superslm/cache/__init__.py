"""cache layer: KV page bookkeeping (the page pool and its prefix cache) and content hashes of pages."""

from superslm.cache.pages import CacheStats, PagePool, PageState
from superslm.cache.prefix_hash import ExtraKey, page_hash, page_hashes

__all__ = ["CacheStats", "ExtraKey", "PagePool", "PageState", "page_hash", "page_hashes"]
