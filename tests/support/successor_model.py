"""Tiny real checkpoints that write a chosen text (helpers, no tests here).

The checkpoint is a tiny Qwen3 whose attention and MLP outputs are zeroed, so the last hidden
state is the current token's own embedding and each next token is a function of the current token
alone. Its LM head is set so that each token of a chain is followed by the next one; the chains
start at the last token of a rendered prompt, so what the model writes depends on the prompt's
end (e.g. on the generation prompt a chat template writes). Each greedy reply is thus produced by
a real forward pass of a real model through the whole serving path.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import tokenizers
from safetensors.torch import load_file, save_file


def successor_checkpoint(make_checkpoint: Callable[..., Path], demo_dir: Path, dest: Path, template: str,
                         added: list[tokenizers.AddedToken]) -> Path:
    """A copy at `dest` of a tiny Qwen3 with the demo tokenizer plus `added` tokens and the chat
    `template`; its successors are set by `set_successors`."""
    tok = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    path = Path(shutil.copytree(make_checkpoint("qwen3", vocab_size=vocab + len(added), tie_word_embeddings=False),
                                dest))
    tok.add_tokens(added)
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return path


def set_successors(path: Path, chains: list[list[int]]) -> None:
    """Makes each token of each chain followed by the next one. A token may end several chains
    (its head row sums their directions) but may not be followed by two different tokens."""
    following: dict[int, int] = {}
    for chain in chains:
        for current, nxt in itertools.pairwise(chain):
            assert following.setdefault(current, nxt) == nxt, f"token {current} would have two successors"
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()  # every layer adds nothing: the last hidden state is the token's own embedding
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    weights["model.norm.weight"].fill_(1.0)
    head.zero_()
    for current, nxt in following.items():
        head[nxt] += 50 * embed[current] / embed[current].norm()
    save_file(weights, path / "model.safetensors")
