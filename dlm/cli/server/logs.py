"""The server's loggers (dlm's own and uvicorn's) and their level, set at start (`--log-level`)
and again by a reload (`Service.reload`)."""

from __future__ import annotations

import logging

LOGGERS = ("dlm", "uvicorn", "uvicorn.error")


def set_log_level(level: str) -> None:
    for name in LOGGERS:
        logging.getLogger(name).setLevel(level.upper())
