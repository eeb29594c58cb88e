"""The runtime: request state, batches, runners, caches, the scheduler and the engine loop."""
