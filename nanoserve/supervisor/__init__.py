"""The data-parallel supervisor (`serve --data-parallel-size N`): replicas and the router as child
processes, started, watched and stopped together. It imports nothing of the engine."""
