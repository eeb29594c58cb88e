"""Acceptance checks of a running OpenAI-compatible dLLM server (`dlm validate`).

Like `dlm.cli.client`, this package talks HTTP only: it never imports the engine core or the
server, so it validates any deployment the same way CI would see it.
"""
