"""The block pool: bookkeeping for the physical KV blocks of one preallocated cache tensor.

Pure Python (no torch): the tensor itself lives with the model runner; this class only decides
which block ids are free. Invariant: a block is on the free list iff its reference count is 0.
References are held by live requests (one per block-table entry) and by the prefix cache (one
per block stored in the radix tree).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free; nothing was allocated."""


class BlockPool:
    """`num_blocks` reference-counted block ids. allocate/free are O(blocks touched)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each with one reference."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        """Drops one reference from each block; blocks reaching zero go back on the free list."""
        for b in blocks:
            count = self.ref_counts[b] - 1
            assert count >= 0, f"decref of free block {b}"
            self.ref_counts[b] = count
            if count == 0:
                self._free.append(b)

    def free_block_ids(self) -> list[int]:
        """A snapshot of the free list (for invariant checks)."""
        return list(self._free)
