"""Reference attention backend in plain torch (the CPU path).

Decode sequences (one query token each) are attended in one batched call over their gathered,
padded block tables; prefill chunks are attended one sequence at a time, causally with the
cached prefix in front of the new tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.attention.metadata import AttentionBackend, AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores each new token's K and V at its flat slot (block * block_size + offset)."""
    _, _, _, kvh, d = kv_cache.shape
    kv_cache[0].view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, kvh, d).index_copy_(0, slot_mapping, v)


class TorchAttention(AttentionBackend):
    """Torch SDPA over gathered blocks. Padding slots are masked out, and the pool is zero-filled
    at allocation so padded reads never meet a NaN."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        _, bs, kvh, d = k_cache.shape
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            max_len = max(meta.seq_lens_cpu[:nd])
            nblk = -(-max_len // bs)
            # index_select, not k_cache[tables]: advanced indexing is several times slower on CPU.
            tables = meta.block_tables[:nd, :nblk].flatten()
            kd = k_cache.index_select(0, tables).view(nd, nblk * bs, kvh, d).transpose(1, 2)
            vd = v_cache.index_select(0, tables).view(nd, nblk * bs, kvh, d).transpose(1, 2)
            mask = torch.arange(nblk * bs, device=q.device) < meta.seq_lens[:nd, None]
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), kd, vd, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
            )
            out[:nd] = o.squeeze(2)
        qsl = meta.query_start_loc_cpu
        for s in range(nd, meta.num_seqs):
            start, end, seq_len = qsl[s], qsl[s + 1], meta.seq_lens_cpu[s]
            q_len = end - start
            nblk = -(-seq_len // bs)
            blocks = meta.block_tables[s, :nblk]
            ks = k_cache.index_select(0, blocks).view(-1, kvh, d)[:seq_len].transpose(0, 1)
            vs = v_cache.index_select(0, blocks).view(-1, kvh, d)[:seq_len].transpose(0, 1)
            mask = None
            if seq_len != q_len:
                rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), ks, vs, attn_mask=mask, is_causal=mask is None,
                scale=scale, enable_gqa=True,
            )
            out[start:end] = o.transpose(0, 1)
        return out
