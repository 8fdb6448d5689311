"""Radix-tree prefix cache over token ids at block granularity (as in SGLang's RadixAttention).

Each edge holds a run of whole blocks: `key` is the tokens (a multiple of block_size long) and
`blocks` the physical block ids holding their K/V. Children are indexed by their first block's
tokens, so two children never share a first block.

Invariants:
- the tree holds exactly one pool reference on every block stored in it;
- `lock_ref` of a node counts the live requests whose matched or inserted path passes through
  it; a request locks the deepest node it uses, which locks the whole path to the root;
- a node with `lock_ref == 0` has no live request reading its blocks, so evicting it frees them;
- `evictable_blocks + protected_blocks == total blocks in the tree`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple

from nanoserve.kv.block_pool import BlockPool


class RadixNode:
    """One edge of the tree (the root has an empty key)."""

    __slots__ = ("blocks", "children", "key", "last_access", "lock_ref", "parent")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.blocks = blocks
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0


class MatchResult(NamedTuple):
    """The cached prefix of a query: its blocks, and the deepest node they end in (to lock)."""

    blocks: list[int]
    node: RadixNode


class RadixCache:
    """Prefix cache; shares the block pool with live requests through reference counts."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = RadixNode((), [], None)
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.evictable_blocks = 0
        self.protected_blocks = 0
        self.evictions = 0
        self.num_nodes = 0  # the root aside

    @property
    def total_blocks(self) -> int:
        return self.evictable_blocks + self.protected_blocks

    def _first_block(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.block_size])

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached block-aligned prefix of `tokens`. Splits an edge that matches only in
        part, so the returned node ends exactly at the match. Touches the path for LRU."""
        size, node, blocks, pos = self.block_size, self.root, [], 0
        now = next(self._clock)
        node.last_access = now
        while pos + size <= len(tokens):
            child = node.children.get(self._first_block(tokens, pos))
            if child is None:
                break
            n = self._common_blocks(child.key, tokens, pos)
            if n < len(child.blocks):
                child = self._split(child, n)
            child.last_access = now
            blocks.extend(child.blocks)
            pos += n * size
            node = child
        return MatchResult(blocks, node)

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], start: RadixNode | None = None) -> RadixNode:
        """Stores `blocks` (holding the K/V of `tokens`, block-aligned), as children of `start`
        (default: the root; `tokens` then continue the path that ends at `start`), and returns the
        node where they end. Blocks of a prefix already cached are not taken: the tree keeps its
        own and the caller keeps its references to its duplicates, so no live request ever points
        at a block the tree frees."""
        size = self.block_size
        assert len(tokens) == len(blocks) * size, "insert takes whole blocks"
        node, pos = start or self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(self._first_block(tokens, pos))
            if child is None:
                i = pos // size
                new = RadixNode(tuple(tokens[pos:]), list(blocks[i:]), node)
                new.last_access = now
                node.children[new.key[:size]] = new
                self.pool.incref(new.blocks)
                self.evictable_blocks += len(new.blocks)
                self.num_nodes += 1
                return new
            n = self._common_blocks(child.key, tokens, pos)
            if n < len(child.blocks):
                child = self._split(child, n)
            child.last_access = now
            pos += n * size
            node = child
        return node

    def lock(self, node: RadixNode) -> None:
        """Pins node and its ancestors against eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks)
                self.protected_blocks += len(node.blocks)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            if node.lock_ref == 0:
                self.evictable_blocks += len(node.blocks)
                self.protected_blocks -= len(node.blocks)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_blocks: int) -> int:
        """Drops unpinned leaves, least recently used first, until `num_blocks` blocks have been
        released to the pool or nothing evictable is left. Returns the number released."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        released = 0
        while released < num_blocks and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.block_size]]
            self.pool.decref(node.blocks)
            self.evictable_blocks -= len(node.blocks)
            released += len(node.blocks)
            self.evictions += len(node.blocks)
            self.num_nodes -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return released

    def _common_blocks(self, key: tuple[int, ...], tokens: Sequence[int], pos: int) -> int:
        """How many whole blocks of `key` equal tokens[pos:]."""
        size, n = self.block_size, 0
        while (n + 1) * size <= len(key) and pos + (n + 1) * size <= len(tokens):
            if key[n * size : (n + 1) * size] != tuple(tokens[pos + n * size : pos + (n + 1) * size]):
                break
            n += 1
        return n

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cuts `node` after its first n blocks; returns the new upper part."""
        size = self.block_size
        parent = node.parent
        assert parent is not None and 0 < n < len(node.blocks)
        upper = RadixNode(node.key[: n * size], node.blocks[:n], parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        parent.children[upper.key[:size]] = upper
        node.key, node.blocks, node.parent = node.key[n * size :], node.blocks[n:], upper
        upper.children[node.key[:size]] = node
        self.num_nodes += 1
        return upper

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def walk(self, limit: int | None = None) -> list[tuple[RadixNode, int]]:
        """The nodes but the root, breadth first (parents before children), each with its
        parent's position in this list (-1: the root); the first `limit` of them if given.
        Read-only: for views of the tree's shape."""
        out: list[tuple[RadixNode, int]] = [(child, -1) for child in self.root.children.values()]
        i = 0
        while i < len(out) and (limit is None or len(out) < limit):
            out.extend((child, i) for child in out[i][0].children.values())
            i += 1
        return out if limit is None else out[:limit]
