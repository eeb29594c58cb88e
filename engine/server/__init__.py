"""The HTTP layer: an OpenAI-compatible FastAPI app over engine.async_engine.

Depends on the engine; the engine never imports this package.
"""
