"""`--quantization dense`, the reference mode: a GGUF file's block matrices (a tied LM head
included) become dense matrices of the model's dtype at load, with the dequantized values, so no
product quantizes its activations; one log line says so."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nanoserve.model import CausalLM, load_model
from nanoserve.model.checkpoint.gguf_export import export_gguf
from nanoserve.model.checkpoint.gguf_reader import read_gguf
from nanoserve.model.checkpoint.weights import load_weights
from nanoserve.model.families import FAMILIES
from nanoserve.model.layer_ops import select_layer_ops
from nanoserve.model.quant.block_quant import BlockQuantWeight
from nanoserve.model.quant.weight_formats import DenseWeight, LinearWeight

from support.forward import forward_chunks


def test_dense_dequantizes_every_block_matrix(make_checkpoint: Callable[..., Path], tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    path = export_gguf(make_checkpoint("qwen2"), tmp_path / "q8.gguf", "Q8_0")  # tied: the head is token_embd
    kept = load_model(path, dtype=torch.float32)
    assert isinstance(kept.model.embed_tokens, BlockQuantWeight)
    with caplog.at_level(logging.INFO, logger="nanoserve.model.checkpoint.loader"):
        dense = load_model(path, dtype=torch.float32, quantization="dense")
    assert any("--quantization dense: dequantizing its q8_0 matrices to float32" in r.message
               for r in caplog.records)
    weights = [m for m in dense.model.modules() if isinstance(m, LinearWeight)]
    assert weights and all(isinstance(w, DenseWeight) and w.weight.dtype == torch.float32 for w in weights)
    # The values are the file's blocks dequantized (the loader's path for a dense destination).
    expected = CausalLM(dense.config, torch.float32)
    load_weights(expected, read_gguf(path).weights(torch.float32), FAMILIES[dense.config.family])
    for (name, ours), (_, theirs) in zip(dense.model.state_dict().items(), expected.state_dict().items(), strict=True):
        assert torch.equal(ours, theirs), name
    # Decoding one token a step on the engine's CPU ops, the kept model's products quantize their
    # activations and the reference's do not: the logits differ, a little.
    for loaded in (kept, dense):
        loaded.model.ops = select_layer_ops("auto", torch.device("cpu"), torch.float32)
    steps = [[[t] for t in (5, 17, 33, 2, 9, 41, 8, 3)]]
    got, want = forward_chunks(kept, steps)[0], forward_chunks(dense, steps)[0]
    assert not torch.equal(got, want)
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())


def test_dense_is_a_cli_choice() -> None:
    from nanoserve.engine.args import EngineArgs

    assert EngineArgs(quantization="dense").quantization == "dense"
    with pytest.raises(ValueError, match="quantization must be one of none, int8, dense"):
        EngineArgs(quantization="fp4")
