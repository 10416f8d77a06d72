"""Turning a model's free-text reply into one ALFWorld command.

The convention (also stated in the environment's default system prompt):

1. The command is the **last line that starts with** ``>`` (the ``>`` and spaces after it removed),
   so a reply may think first: ``"The apple is usually in the fridge.\\n> go to fridge 1"``.
2. Without such a line, the command is the **last non-empty line** of the reply.
3. The command is normalised: a leading ``Action:``/``Command:`` label, surrounding quotes or
   backticks and trailing ``.``/``!`` are removed, it is lower-cased and runs of whitespace become
   one space.
4. ``put X in Y``, ``put X on Y`` and ``put X in/on Y`` become ``move X to Y``: the ALFWorld grammar's
   verb is ``move``, while ALFWorld's own prompts and most models say ``put``.

Whatever results is sent to the engine verbatim; anything that is not an admissible command answers
"Nothing happens." and changes nothing.
"""

from __future__ import annotations

import re

_LABEL = re.compile(r"^(?:action|command)\s*:\s*", re.IGNORECASE)
_PUT = re.compile(r"^put (?P<obj>.+?) (?:in/on|in|on|into|onto) (?P<recep>.+)$")


def parse_command(reply: str) -> str:
    """The command a reply asks for (see the module docstring); ``""`` for an empty reply."""
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    if not lines:
        return ""
    marked = [line for line in lines if line.startswith(">")]
    command = marked[-1].lstrip(">").strip() if marked else lines[-1]
    command = _LABEL.sub("", command)
    command = command.strip().strip("`\"'").strip().rstrip(".!").strip()
    command = " ".join(command.lower().split())
    match = _PUT.match(command)
    if match:
        command = f"move {match['obj']} to {match['recep']}"
    return command
