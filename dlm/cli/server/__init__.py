"""The HTTP layer: an OpenAI-compatible FastAPI app over dlm.engine.runtime.async_engine.

Depends on the engine; the engine never imports this package.
"""
