"""Prompt templates: how a task's question becomes the chat messages the model sees."""

from __future__ import annotations

from dataclasses import dataclass

from flashrl.envs.math.tasks import MathTask


@dataclass(frozen=True)
class PromptTemplate:
    """A user message built from the question, with an optional system message.

    ``user`` is a :meth:`str.format` string; it may use ``{question}`` (always) and any key of the
    task's metadata of simple type (``{expression}`` for arithmetic tasks).
    """

    user: str = "{question}"
    """The user message; ``{question}`` is replaced by the task's question."""
    system: str | None = None
    """System message; ``None`` leaves it to the chat template (SmolLM2 adds its default one)."""

    def __post_init__(self) -> None:
        if "{question}" not in self.user and "{expression}" not in self.user:
            raise ValueError(
                f"PromptTemplate.user must contain '{{question}}'; got {self.user!r}. Example: "
                "'{question}\\nPut your final answer in \\\\boxed{{}}.'"
            )

    def messages(self, task: MathTask) -> list[dict[str, str]]:
        fields = {k: v for k, v in task.metadata.items() if isinstance(v, (str, int, float))}
        content = self.user.format(**{**fields, "question": task.question})
        out = [] if self.system is None else [{"role": "system", "content": self.system}]
        return out + [{"role": "user", "content": content}]


#: Named templates. ``plain`` shows the question alone (the easy-sums preset: the reward reads the
#: last number of the reply); ``boxed`` asks for a boxed final answer, which the verifier prefers.
TEMPLATES: dict[str, PromptTemplate] = {
    "plain": PromptTemplate("{question}"),
    "boxed": PromptTemplate("{question}\nPut your final answer in \\boxed{{}}."),
    "step_by_step": PromptTemplate(
        "{question}\nThink step by step, then give the final answer in \\boxed{{}}."
    ),
}


def resolve_template(template: PromptTemplate | str | None, default: str) -> PromptTemplate:
    """A :class:`PromptTemplate` from an instance, a name in :data:`TEMPLATES` or a format string."""
    if template is None:
        return TEMPLATES[default]
    if isinstance(template, PromptTemplate):
        return template
    if isinstance(template, str):
        if template in TEMPLATES:
            return TEMPLATES[template]
        if "{" in template:
            return PromptTemplate(template)
        raise ValueError(
            f"Unknown template {template!r}: expected one of {sorted(TEMPLATES)}, a format string "
            "with '{question}', or a PromptTemplate."
        )
    raise TypeError(f"template must be a PromptTemplate, a str or None; got {type(template).__name__}.")
