"""Each builder method of FlashReinforceConfig names its section's settings: keyword-only parameters typed
as their fields, NotProvided by default, one Args entry each (what help() and an IDE show)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import pydoc
import textwrap

import pytest

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.builder_methods import BuilderMethods, NotProvided
from flashrl.algorithms.flash_reinforce.config import _PARTS, _SECTIONS
from flashrl.validation import DERIVED

SECTIONS = sorted(set(_SECTIONS.values()))
POSITIONAL = {"environment": "env", "callbacks": "callbacks_class"}  # .environment(env), .callbacks(cls)
WHERE = "flashrl/algorithms/flash_reinforce/builder_methods.py"


def _fields() -> dict[str, dataclasses.Field]:
    parts = [cls for cls, _ in _PARTS.values()]
    return {f.name: f for cls in parts for f in dataclasses.fields(cls) if DERIVED not in f.metadata}


def _field_docs() -> dict[str, str]:
    """Each setting's docstring (the string under its field), whitespace collapsed."""
    docs = {}
    for cls, _ in _PARTS.values():
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for field, doc in itertools.pairwise(body):
            if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr):
                docs.setdefault(field.target.id, " ".join(doc.value.value.split()))
    return docs


def _args_entries(method) -> dict[str, str]:
    """The Args section of a Google-style docstring: name -> its text (continuation lines joined)."""
    lines = inspect.cleandoc(method.__doc__).splitlines()
    entries: dict[str, str] = {}
    name = None
    for line in lines[lines.index("Args:") + 1:]:
        if not line.strip():
            break
        if line.startswith("    ") and not line.startswith("        "):
            name, _, text = line.strip().partition(": ")
            entries[name] = text
        else:
            entries[name] += " " + line.strip()
    return entries


def _declared(section: str) -> list[str]:
    return [name for name, where in _SECTIONS.items() if where == section]


def test_there_is_one_builder_method_per_section():
    methods = {name for name, value in vars(BuilderMethods).items()
               if inspect.isfunction(value) and not name.startswith("_")}
    assert methods == set(SECTIONS)


@pytest.mark.parametrize("section", SECTIONS)
def test_a_builder_method_takes_exactly_its_sections_settings(section):
    method = getattr(FlashReinforceConfig, section)
    parameters = list(inspect.signature(method).parameters.values())[1:]  # after self
    assert parameters[-1].kind is inspect.Parameter.VAR_KEYWORD  # misplaced: a TypeError naming the method
    named = {p.name: p for p in parameters[:-1]}
    missing = [name for name in _declared(section) if name not in named]
    assert not missing, (
        f"FlashReinforceConfig.{section}() lacks keyword-only parameters for {missing} (fields with "
        f"section={section!r}): add them to {section}() in {WHERE}, typed as the field, default NotProvided, "
        "with an Args line each")
    extra = sorted(set(named) - set(_declared(section)))
    assert not extra, f"{section}() takes {extra}, which no field with section={section!r} declares"
    fields = _fields()
    for name, parameter in named.items():
        kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if POSITIONAL.get(section) == name
                else inspect.Parameter.KEYWORD_ONLY)
        assert (parameter.kind, parameter.default) == (kind, NotProvided), name
        assert parameter.annotation == fields[name].type, f"{section}({name}=): type it {fields[name].type}"


@pytest.mark.parametrize("section", SECTIONS)
def test_each_setting_has_its_fields_docstring_under_args(section):
    entries = _args_entries(getattr(FlashReinforceConfig, section))
    docs = _field_docs()
    for name in _declared(section):
        assert name in entries, f"{section}() docstring: add an Args line '{name}: <its field's docstring>'"
        assert entries[name] and docs[name].startswith(entries[name]), (
            f"{section}() docstring, {name}: expected the start of its field's docstring {docs[name]!r}, "
            f"got {entries[name]!r}")


def test_help_lists_the_settings_with_their_docs():
    text = pydoc.render_doc(FlashReinforceConfig.training, renderer=pydoc.plaintext)
    assert "training(self, *, train_batch_size: 'int' = NotProvided," in text
    assert "delta: 'float' = NotProvided" in text and "**misplaced: 'Any'" in text
    assert "delta: Sequence trust region: a trajectory whose mean token drift exceeds it" in text
    evaluation = pydoc.render_doc(FlashReinforceConfig.evaluation)
    assert "evaluation_interval: 'int | None' = NotProvided" in evaluation


def test_a_setting_left_out_keeps_its_value_and_a_given_one_is_set():
    config = FlashReinforceConfig().training(lr=3e-6, delta=0.003).training(delta=0.02)
    assert (config.lr, config.delta, config.train_batch_size) == (3e-6, 0.02, 32)
    config = config.environment("flashrl/Math-v0").environment(max_samples=5).evaluation(evaluation_interval=2)
    assert (config.env, config.max_samples, config.evaluation_interval) == ("flashrl/Math-v0", 5, 2)
    assert config.evaluation(evaluation_interval=None).evaluation_interval is None  # None is a value
    with pytest.raises(TypeError, match=r"^environment\(\) got an unexpected keyword argument 'lr': it is set "
                                        r"by \.training\(\)$"):
        FlashReinforceConfig().environment("flashrl/Math-v0", lr=1.0)
