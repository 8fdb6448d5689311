"""Subcommands of the `nanoserve` CLI; each module has `register(subparsers)`."""
