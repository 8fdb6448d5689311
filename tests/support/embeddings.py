"""The reference embedding of a tiny checkpoint (no tests here): transformers' final hidden states
(after the model's final norm), pooled and L2-normalized in fp32."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_embeddings(path: Path, prompts: list[list[int]], method: str) -> list[torch.Tensor]:
    """Each prompt's vector: the mean of its rows ("mean") or its last row ("last"), normalized."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            hidden = hf.model(torch.tensor([p])).last_hidden_state[0]
            pooled = hidden.mean(dim=0) if method == "mean" else hidden[-1]
            out.append(torch.nn.functional.normalize(pooled, dim=0))
    return out


def cosine(a: list[float], b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float32), b, dim=0))
