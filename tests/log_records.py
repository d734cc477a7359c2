"""A logging handler that keeps the WARNING-and-above records of a logger, for tests that assert a
run (compiled, wrapped) logs nothing of plait's or torch's making."""

from __future__ import annotations

import logging


class WarningRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
