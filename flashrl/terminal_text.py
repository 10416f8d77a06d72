"""Text for a human's terminal: the model's and the tools' text with its terminal controls made visible.

Model text is hostile (``docs/agents.md``, "Security"): a sampled reply, or a tool's output, may hold
bytes that a terminal obeys rather than shows. An OSC 52 sequence (``ESC ] 52 ; c ; <base64> BEL``)
writes the user's clipboard, a CSI sequence moves the cursor or rewrites earlier lines, ``\\r``
overwrites the line it is on, and a bidi override reorders what follows. Wherever flashrl shows such
text to a person (``flashrl show``, the console lines, every log record of a ``flashrl.*`` logger),
:func:`escape_terminal` writes each such character as its Python escape (``\\x1b``, ``\\x9b``,
``\\u202e``) instead: the sequence shows, and does nothing.

Escaped: the C0 controls except ``\\n`` and ``\\t`` (so ESC, BEL, ``\\r``, backspace), DEL, the C1
controls ``\\x80``-``\\x9f`` (8-bit CSI and OSC among them), and the bidi embeddings, overrides,
isolates and marks. Escaping ESC and the C1 introducers is enough to make every ESC, CSI and OSC
sequence inert: what follows them is printable text. A backslash is not escaped, so a reply's own
``\\x1b`` (four characters) reads like an escaped ESC: the text is for reading, not for parsing back.

What is *kept* as data stays exact: the sandbox's ``SandboxResult.stdout``, the tool responses the
model is trained on, the rollout dump (JSON, which escapes controls itself). Only what is printed or
logged for a person goes through here.

:func:`install_log_escaping` makes every ``flashrl.*`` log record escaped at its creation, in each
process that imports flashrl (``flashrl/__init__.py`` installs it), so a log line of an EnvRunner actor
that quotes a model's reply (an env error, a refused reward) reaches the driver's terminal inert.
"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["escape_terminal", "install_log_escaping"]

_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""C0 controls but \\n (0x0a) and \\t (0x09), DEL, C1, and the bidi marks, embeddings, overrides, isolates."""


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code == 0x0D:
        return "\\r"  # as repr() writes it: the common one (a tool's CRLF line ends)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_terminal(text: str) -> str:
    """``text`` with every terminal control but ``\\n`` and ``\\t`` written as its escape (``\\x1b``)."""
    return _CONTROLS.sub(_escape, text)


def _escape_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - arguments that do not format: logging reports it when it emits
        return
    escaped = escape_terminal(message)
    if escaped != message:
        record.msg, record.args = escaped, ()
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        text = logging.Formatter().formatException(record.exc_info)
        escaped = escape_terminal(text)
        if escaped != text:
            record.exc_text = escaped  # a Formatter uses exc_text when it is set


class _EscapingFactory:
    """The log record factory: the one before it, then `_escape_record` for flashrl's own records."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self.previous(*args, **kwargs)
        if record.name == "flashrl" or record.name.startswith("flashrl."):
            _escape_record(record)
        return record


def install_log_escaping() -> None:
    """Escape the terminal controls of every ``flashrl.*`` log record of this process (idempotent).

    A record factory, not a handler's filter, because flashrl installs no handler (the user's or Ray's
    logging emits the records) and a logger's filter does not apply to its children's records.
    """
    current = logging.getLogRecordFactory()
    if not isinstance(current, _EscapingFactory):
        logging.setLogRecordFactory(_EscapingFactory(current))
