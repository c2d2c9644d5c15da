"""How text that a job's user controls is shown by the root hooks: on one line, bounded.

The hook log is root's only record of what the hooks did, and the TaskProlog's
output is read line by line by slurmstepd. A manifest field, a file name, a
``--comment`` or an error message quoting any of them comes from the user: a
newline in it would forge a log line (or an ``export`` line), and a 20 MB
field would become a 20 MB record. Every such string goes through
:func:`escape` before a log or the TaskProlog sees it; the hook log's
formatter (:class:`OneLineFormatter`) applies it again to each whole record.
"""

from __future__ import annotations

import logging
import re

__all__ = ["FIELD_LIMIT", "RECORD_LIMIT", "OneLineFormatter", "escape"]

FIELD_LIMIT = 1000
"""Characters kept of one user-derived string."""
RECORD_LIMIT = 8000
"""Characters kept of one log record (a traceback included)."""

_PLAIN = re.compile(r"[ -~]*")  # printable ASCII: nothing to escape


def escape(value: object, limit: int = FIELD_LIMIT) -> str:
    """``value`` as one printable line of at most ``limit`` characters before escaping.

    Characters that are not printable (newlines, escape sequences, bidi
    controls, the surrogates a non-UTF-8 file name decodes to) are written as
    Python escapes (``\\n``, ``\\x1b``, ``\\u202e``); what is cut off is counted.
    Only the kept part is looked at, so a huge value costs no more than a short one.
    """
    text = value if isinstance(value, str) else str(value)
    head = text[:limit]
    if not _PLAIN.fullmatch(head):
        head = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in head)
    if len(text) > limit:
        head += f"...[{len(text) - limit} more characters]"
    return head


class OneLineFormatter(logging.Formatter):
    """Each record on one line of bounded length, whatever its message or traceback holds."""

    def format(self, record: logging.LogRecord) -> str:
        return escape(super().format(record), RECORD_LIMIT)
