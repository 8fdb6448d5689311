"""Checkpoints in and out: resolving a source and loading it (`loader`, safetensors read here),
the name mapping onto the decoder (`weights`), GGUF files read (`gguf_reader`) and written
(`gguf_export`)."""
