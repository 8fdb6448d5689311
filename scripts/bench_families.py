"""Single-stream CPU decode speed of the Llama-shaped families at one size, random weights.

Every family gets the same shape (SmolLM2-135M's widths: hidden 576, 9 heads over 3 KV heads of 64,
intermediate 1536, a 49,152-row tied embedding, `--layers` layers), written by transformers' own
classes in bf16 with the demo tokenizer, so each step reads the same weight bytes; the families differ
only in their switches: Phi-3 (fused tensors; full rotary), Phi-4-mini-style partial rotary (0.75),
Granite's multipliers, SmolLM3's rotary-free layers. Each is run in bf16 and with its layer matrices as
Q8_0 blocks (`quantization="int8"`), the rounds interleaved, and the median tok/s printed beside
whether the native decoder took the steps.

    PYTHONPATH=. python scripts/bench_families.py --layers 12 --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.model.demo import demo_model_path

SHAPE: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                             num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
                             tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {}),
    "phi3": ("Phi3", {}),
    "phi3 partial rotary": ("Phi3", dict(partial_rotary_factor=0.75)),
    "granite": ("Granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                                logits_scaling=2.0)),
    "smollm3": ("SmolLM3", {}),
}


def write(name: str, layers: int, root: Path) -> Path:
    import transformers

    cls, overrides = FAMILIES[name]
    fields = {**SHAPE, "num_hidden_layers": layers, **overrides}
    if cls == "Phi3":
        fields.pop("head_dim")  # Phi3Config derives it (576 / 9 = 64)
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**fields))
    path = root / name.replace(" ", "-")
    model.to(torch.bfloat16).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_path() / f, path / f)
    return path


def decode_rate(llm: LLM, new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompt = list(range(10, 26))
    start = time.perf_counter()
    llm.generate([prompt], params)
    return new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engines: dict[tuple[str, str], LLM] = {}
        for name in FAMILIES:
            path = write(name, args.layers, Path(tmp))
            for quant in ("none", "int8"):
                llm = LLM(str(path), dtype="bfloat16", quantization=quant, max_model_len=256, max_num_seqs=1)
                decode_rate(llm, 8)  # warm-up
                engines[(name, quant)] = llm
        rates: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
        for _ in range(args.rounds):
            for key, llm in engines.items():
                rates[key].append(decode_rate(llm, args.tokens))
    print(f"| family | weights | decode tok/s (median of {args.rounds}) | vs llama | native decoder |")
    print("|---|---|---|---|---|")
    for (name, quant), values in rates.items():
        rate, base = statistics.median(values), statistics.median(rates[("llama", quant)])
        native = engines[(name, quant)].engine.runner.native is not None  # type: ignore[attr-defined]
        print(f"| {name} | {'bf16' if quant == 'none' else 'Q8_0'} | {rate:.1f} | {rate / base:.2f} | "
              f"{'yes' if native else 'no'} |")


if __name__ == "__main__":
    main()
