"""Server logging: rate-limited error logs (a failure loop must not flood the log) and a JSON-lines format.

`RateLimitedLog.exception(key, ...)` logs the first failure of a kind with its traceback, then at most one
line per `interval_s` for that kind, saying how many were suppressed meanwhile. `JsonFormatter` writes
one JSON object per line (time, level, logger, message, and `request_id` / other extras when a record
carries them), for log shippers.
"""
from __future__ import annotations

import json
import logging
import threading
import time

EXTRA_FIELDS = ("request_id", "status", "path", "method", "duration_s", "finish_reason", "prompt_tokens", "completion_tokens", "error_code")


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, clock=time.monotonic):
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()
        self.suppressed_total = 0

    def _admit(self, key: str) -> int | None:
        """None: suppress this one; else the number suppressed since the last line of this kind."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                self.suppressed_total += 1
                return None
            self._last[key] = now
            return self._suppressed.pop(key, 0)

    def exception(self, key: str, message: str, *args, exc_info=True) -> bool:
        """Log `message` (with the traceback) unless one of this kind was logged within interval_s; True if logged."""
        suppressed = self._admit(key)
        if suppressed is None:
            return False
        suffix = f" ({suppressed} more like this in the last {self.interval_s:g} s were not logged)" if suppressed else ""
        self.logger.error(message + suffix, *args, exc_info=exc_info)
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        for name in EXTRA_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                body[name] = value
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def configure(level: str = "info", json_lines: bool = False) -> None:
    """The tandem.server logger: plain lines or JSON lines on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("tandem.server")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
