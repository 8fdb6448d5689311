"""Checkpoints in and out: resolving a source and loading it (`loader`, safetensors read here),
the name mapping onto the decoder (`weights`), GGUF files read (`gguf_reader`; `gguf_header`
reads a file's head alone) and written (`gguf_export`)."""
