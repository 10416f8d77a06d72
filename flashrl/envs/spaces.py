"""Gymnasium spaces for language environments: free text and lists of chat messages.

Gymnasium's own :class:`gymnasium.spaces.Text` only contains strings drawn from a fixed character set
(alphanumeric by default), so a model reply with spaces, punctuation, newlines or any non-ASCII
character would not be ``in`` it. The spaces here accept any Python string up to a length bound, and
sample from a printable charset (which is all ``check_env`` needs to drive an environment).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.spaces import Space

#: Characters :meth:`UnicodeText.sample` draws from (letters, digits, punctuation, space, newline).
SAMPLE_CHARSET: str = string.ascii_letters + string.digits + string.punctuation + " \n"

#: Roles a chat message may carry unless an environment declares others.
DEFAULT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


class UnicodeText(Space[str]):
    """Any Python ``str`` whose length (in characters) lies in ``[min_length, max_length]``.

    Unlike :class:`gymnasium.spaces.Text`, membership does not depend on a character set: every
    Unicode character is allowed. :meth:`sample` draws ``sample_max_length`` characters at most from
    :data:`SAMPLE_CHARSET`, so random actions stay short and readable.
    """

    def __init__(
        self,
        max_length: int,
        *,
        min_length: int = 0,
        sample_max_length: int = 64,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        if not 0 <= min_length <= max_length:
            raise ValueError(
                f"UnicodeText needs 0 <= min_length <= max_length; got min_length={min_length}, "
                f"max_length={max_length}."
            )
        self.min_length = int(min_length)
        self.max_length = int(max_length)
        self.sample_max_length = int(max(min_length, min(sample_max_length, max_length)))
        super().__init__(dtype=str, seed=seed)

    def sample(self, mask: Any | None = None, probability: Any | None = None) -> str:
        if mask is not None or probability is not None:
            raise NotImplementedError("UnicodeText.sample does not support mask or probability.")
        length = int(self.np_random.integers(self.min_length, self.sample_max_length + 1))
        chars = self.np_random.choice(list(SAMPLE_CHARSET), size=length)
        return "".join(chars.tolist())

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, UnicodeText)
            and self.min_length == other.min_length
            and self.max_length == other.max_length
        )


class ChatMessages(Space[list[dict[str, str]]]):
    """A list of chat messages, each a ``dict`` with exactly the keys ``"role"`` and ``"content"``.

    An element is ``[{"role": "user", "content": "What is 2 + 3?"}, ...]`` with at most
    ``max_messages`` messages, every role one of ``roles`` and every content a ``str`` of at most
    ``max_content_length`` characters (any Unicode). The empty list is an element: environments
    return it from ``step`` when the episode has ended and there is nothing to append.
    """

    def __init__(
        self,
        *,
        roles: Sequence[str] = DEFAULT_ROLES,
        max_messages: int = 64,
        max_content_length: int = 1_000_000,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        if not roles:
            raise ValueError("ChatMessages needs at least one role; got an empty sequence.")
        if max_messages < 0 or max_content_length < 0:
            raise ValueError(
                f"ChatMessages needs max_messages >= 0 and max_content_length >= 0; got "
                f"{max_messages} and {max_content_length}."
            )
        self.roles = tuple(roles)
        self.max_messages = int(max_messages)
        self.max_content_length = int(max_content_length)
        self._content = UnicodeText(self.max_content_length, sample_max_length=32)
        super().__init__(dtype=None, seed=seed)

    def seed(self, seed: int | None = None) -> int | Any:
        result = super().seed(seed)
        self._content.seed(int(self.np_random.integers(2**31)))
        return result

    def sample(self, mask: Any | None = None, probability: Any | None = None) -> list[dict[str, str]]:
        if mask is not None or probability is not None:
            raise NotImplementedError("ChatMessages.sample does not support mask or probability.")
        n = int(self.np_random.integers(0, min(self.max_messages, 4) + 1))
        return [
            {"role": str(self.np_random.choice(self.roles)), "content": self._content.sample()}
            for _ in range(n)
        ]

    def contains(self, x: Any) -> bool:
        if not isinstance(x, list) or len(x) > self.max_messages:
            return False
        return all(self.is_message(m) for m in x)

    def is_message(self, m: Any) -> bool:
        """Whether ``m`` is one valid message of this space."""
        return (
            isinstance(m, dict)
            and m.keys() == {"role", "content"}
            and m["role"] in self.roles
            and self._content.contains(m["content"])
        )

    def explain(self, x: Any) -> str:
        """Why ``x`` is not an element (empty string when it is), for error messages."""
        if not isinstance(x, list):
            return f"expected a list of messages, got {type(x).__name__}"
        if len(x) > self.max_messages:
            return f"expected at most {self.max_messages} messages, got {len(x)}"
        for i, m in enumerate(x):
            if not isinstance(m, dict):
                return f"message {i} is a {type(m).__name__}, expected a dict"
            if m.keys() != {"role", "content"}:
                return f"message {i} has keys {sorted(m)}, expected exactly ['content', 'role']"
            if m["role"] not in self.roles:
                return f"message {i} has role {m['role']!r}, expected one of {list(self.roles)}"
            if not isinstance(m["content"], str):
                return f"message {i} content is a {type(m['content']).__name__}, expected str"
            if len(m["content"]) > self.max_content_length:
                return (
                    f"message {i} content has {len(m['content'])} characters, at most "
                    f"{self.max_content_length} allowed"
                )
        return ""

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"ChatMessages(roles={self.roles}, max_messages={self.max_messages})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ChatMessages)
            and self.roles == other.roles
            and self.max_messages == other.max_messages
            and self.max_content_length == other.max_content_length
        )
