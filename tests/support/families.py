"""The model families the tiny-checkpoint fixture (conftest.make_checkpoint) builds."""

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
