"""Compute kernels for the denoising hot path.

Each kernel has a pure-torch reference with the same signature; `dlm.kernels.dispatch` is the
one place that decides which implementation runs. Nothing here imports the engine.
"""
