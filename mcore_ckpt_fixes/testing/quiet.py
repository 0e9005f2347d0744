"""Round trips and resume jobs driven through a framework's own functions (Megatron-Bridge, verl,
ms-swift), which print their configuration and log per import, save and load: none of it is the
result, and on many ranks it buries it."""

from __future__ import annotations

import contextlib
import io
import logging


@contextlib.contextmanager
def quiet():
    """stdout swallowed and logging at WARNING and below off inside the block (Python warnings stay recordable)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)
