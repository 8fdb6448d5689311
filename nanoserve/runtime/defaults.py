"""The runtime's defaults that `nanoserve serve --help` shows: a module free of torch, so the
CLI's parser can read them without loading the engine."""

DEFAULT_MAX_RESTARTS = 3  # restarts of a dead engine-core process within `async_engine.RESTART_WINDOW_S`
