"""KV block bookkeeping: a free list, reference counts, and prefix caching.

Prefix caching follows vLLM v1 / nano-vllm: a *full* block is identified by a hash chained
over every token before it (hash of the previous block's hash and this block's tokens),
so equal hashes mean equal prefixes. A block is registered only once its K/V has been
written (after the step that computed it), so a sequence admitted later can never read a
block that is still being filled. Freed blocks keep their hash and stay hittable until the
free list hands them out again, oldest-freed first (an LRU cache for free).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from portlayer.runtime.sequence import Sequence

_ROOT_HASH = 0x5EED


@dataclass
class BlockManagerStats:
    """Counters the tests and the engine's stats read (never reset by the manager)."""

    prefix_query_blocks: int = 0  # full prompt blocks looked up at admission
    prefix_hit_blocks: int = 0  # of those, found in the cache and shared
    evicted_blocks: int = 0  # cached blocks handed out again for new content

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_blocks / self.prefix_query_blocks if self.prefix_query_blocks else 0.0


def chain_hash(prev: int, tokens: tuple[int, ...]) -> int:
    """Hash of one full block given the hash of the block before it (ints hash the same in every process)."""
    return hash((prev, tokens))


class BlockManager:
    """Owns ``num_blocks`` physical blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs >= 1 block of >= 1 slot; got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.stats = BlockManagerStats()

    # ---- queries ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest full-block prefix of ``token_ids``.

        At most (len - 1) // block_size blocks: the last token is always recomputed (its
        logits are needed) and its slot must lie in a block this sequence owns alone.
        """
        if not self.enable_prefix_caching:
            return []
        bs, prev, hits = self.block_size, _ROOT_HASH, []
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            prev = chain_hash(prev, tokens)
            bid = self.hash_to_block.get(prev)
            if bid is None or self.block_tokens[bid] != tokens:
                break
            hits.append(bid)
        return hits

    def admission_cost(self, hits: list[int], total_tokens: int) -> int:
        """Free blocks consumed by admitting a sequence that reuses ``hits`` and fills ``total_tokens``."""
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # cached but on the free list
        return self.blocks_for(total_tokens) - len(hits) + revived

    # ---- mutations -------------------------------------------------------------
    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Share the cached blocks ``hits`` with a freshly admitted ``seq``."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "prefix is taken only at admission"
        self.stats.prefix_query_blocks += (seq.num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0
        self.stats.prefix_hit_blocks += len(hits)
        for bid in hits:
            if self.ref_counts[bid] == 0:
                del self.free[bid]
            self.ref_counts[bid] += 1
            seq.block_hashes.append(self.block_hash[bid])  # type: ignore[arg-type]
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_prompt_tokens = seq.num_computed_tokens
        seq.num_hashed_blocks = len(hits)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more; False (and no change) if short."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(max(0, need)):
            seq.block_table.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        h = self.block_hash[bid]
        if h is not None:
            if self.hash_to_block.get(h) == bid:
                del self.hash_to_block[h]
            self.block_hash[bid] = self.block_tokens[bid] = None
            self.stats.evicted_blocks += 1
        self.ref_counts[bid] = 1
        return bid

    def register_computed(self, seq: Sequence) -> None:
        """Hash the blocks ``seq`` has completely filled since the last call (after a step)."""
        if not self.enable_prefix_caching:
            return
        bs, tokens = self.block_size, None
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // bs):
            tokens = tokens or seq.token_ids
            block = tuple(tokens[i * bs : (i + 1) * bs])
            if min(block) < 0:  # a token still on the device (overlapped step): hash it once it is known
                break
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else _ROOT_HASH, block)
            seq.block_hashes.append(h)
            bid = seq.block_table[i]
            if h not in self.hash_to_block and self.block_hash[bid] is None:
                self.hash_to_block[h] = bid
                self.block_hash[bid], self.block_tokens[bid] = h, block
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, len(seq.block_hashes))

    def free_seq(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (tail first, so shared prefixes stay cached longest)."""
        for bid in reversed(seq.block_table):
            self.ref_counts[bid] -= 1
            assert self.ref_counts[bid] >= 0, f"block {bid} freed more often than taken"
            if self.ref_counts[bid] == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
