"""Weight formats (`weight_formats`: dense, GGUF blocks, stacked), block quantization
(`block_quant`) and the per-matrix choice of format (`quant_config`)."""
