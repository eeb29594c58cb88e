"""Load tests of a running OpenAI-compatible dLLM server (`dlm loadtest`).

Locust drives the load (imported only by `users` and `run`, because importing it
monkey-patches the process for gevent); the statistics, knee detection, thresholds and
reports are plain functions of the recorded requests. Like `dlm.cli.checks`, nothing here
imports the engine core or the server.
"""
