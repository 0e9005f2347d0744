"""The WARNING lines a block logs, as a round trip records them: a fix's own (its runtime's logger,
or Megatron's module where a source diff put the fix's text) apart from the release's."""

from __future__ import annotations

import logging


class Warnings(logging.Handler):
    """The WARNING (and worse) lines logged during the block: ``lines["fix"]`` from the loggers named
    in ``fix_loggers``, ``lines["release"]`` from those under ``release_logger``."""

    def __init__(self, fix_loggers, release_logger):
        super().__init__(logging.WARNING)
        self.fix_loggers, self.release_logger = tuple(fix_loggers), release_logger
        self.lines = {"fix": [], "release": []}

    def emit(self, record):
        if record.name in self.fix_loggers:
            self.lines["fix"].append(record.getMessage())
        elif record.name.startswith(self.release_logger):
            self.lines["release"].append(record.getMessage())

    def __enter__(self):
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger().removeHandler(self)
