"""Model and tool text shown to a person has its terminal controls escaped: an OSC 52 sequence sampled by
the model (it writes the user's clipboard), a CSI sequence, C1 controls and bidi overrides show as text
in `flashrl show`, the console lines and flashrl's log records, and do nothing."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashrl.cli import main
from flashrl.metrics.console import evaluation_line
from flashrl.metrics.rollouts import format_rollout, write_rollouts
from flashrl.terminal_text import escape_terminal

REPO = Path(__file__).resolve().parents[1]
OSC52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"
"""Sets the clipboard to 'echo pwned' on a terminal that allows it."""
CONTROL = set(range(0x20)) - {0x09, 0x0A} | set(range(0x7F, 0xA0)) | {
    0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}


@pytest.mark.parametrize(("text", "shown"), [
    (f"ok{OSC52}done", "ok\\x1b]52;c;ZWNobyBwd25lZA==\\x07done"),
    ("\x1b[2J\x1b[1;1Hcleared", "\\x1b[2J\\x1b[1;1Hcleared"),  # CSI: clear the screen, move the cursor
    ("\x9b31mred\x9d0;title\x9c", "\\x9b31mred\\x9d0;title\\x9c"),  # 8-bit CSI, OSC, ST
    ("rm -rf \u202etxt.exe", "rm -rf \\u202etxt.exe"),  # a right-to-left override
    ("progress 10%\rprogress 100%", "progress 10%\\rprogress 100%"),
    ("bell\x07 back\x08 del\x7f nul\x00", "bell\\x07 back\\x08 del\\x7f nul\\x00"),
    ("two\nlines\tand a tab", "two\nlines\tand a tab"),  # kept: the text stays readable
    ("\\frac{1}{2} = 0.5, café, 日本語, emoji 🙂", "\\frac{1}{2} = 0.5, café, 日本語, emoji 🙂"),
])
def test_terminal_controls_show_as_escapes(text, shown):
    assert escape_terminal(text) == shown


@given(st.text())
def test_no_terminal_control_survives_and_other_text_is_kept(text):
    escaped = escape_terminal(text)
    assert not any(ord(c) in CONTROL for c in escaped)
    assert escape_terminal(escaped) == escaped
    if not any(ord(c) in CONTROL for c in text):
        assert escaped == text


def _record_with(text: str) -> dict:
    return {"iteration": 3, "batch_index": 0, "prompt_id": f"p{OSC52}", "reward": 1.0, "prompt": f"Q {OSC52}",
            "turns": [{"role": "model", "text": f"reply {OSC52}", "num_tokens": 2, "policy_version": 0},
                      {"role": "tool", "text": f"stdout {text}", "num_tokens": 2}],
            "closing": "", "info": {"note": OSC52}}


def test_flashrl_show_prints_a_dumped_osc52_sequence_as_text(tmp_path, capsys):
    record = _record_with("\x1b[2J")
    path = write_rollouts(tmp_path / "rollouts.jsonl", [record])
    assert OSC52 in json.loads(Path(path).read_text())["turns"][0]["text"]  # the dump keeps the text exact
    assert main(["show", path]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "reply \\x1b]52;c;ZWNobyBwd25lZA==\\x07" in out and "stdout \\x1b[2J" in out
    assert "prompt p\\x1b]52;" in out and "Q \\x1b]52;" in out
    assert format_rollout(record) in out


def test_flashrl_show_escapes_an_error_that_quotes_the_file(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"a": 1}}\n"{OSC52}"\n')  # a line of JSON that is not an object
    assert main(["show", str(path)]) == 1
    assert "\x1b" not in capsys.readouterr().err


def test_an_evaluation_split_name_is_escaped_in_the_console_line():
    name = f"held{OSC52}"
    line = evaluation_line({"evaluation/episode_return_mean": 0.5, f"evaluation/{name}/episode_return_mean": 0.25,
                            f"evaluation/{name}/num_episodes": 4.0})
    assert "\x1b" not in line and "| held\\x1b]52;c;ZWNobyBwd25lZA==\\x07 0.250 |" in line


def test_flashrl_log_records_quoting_model_text_are_escaped(caplog):
    stream_records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            stream_records.append(self.format(record))

    handler = Collect()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger = logging.getLogger("flashrl.env_runners.some_module")
    other = logging.getLogger("someone_else")
    for each in (logger, other):
        each.addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING):
            logger.warning("episode %d dropped: %s", 7, f"bad tool call {OSC52}")
            try:
                raise ValueError(f"reply was {OSC52}")
            except ValueError:
                logger.exception("env step failed")
            other.warning("not flashrl's: %s", "\x1b[0m")
    finally:
        for each in (logger, other):
            each.removeHandler(handler)
    assert stream_records[0] == "flashrl.env_runners.some_module: episode 7 dropped: bad tool call " \
                                "\\x1b]52;c;ZWNobyBwd25lZA==\\x07"
    assert "\x1b" not in stream_records[1] and "ValueError: reply was \\x1b]52;" in stream_records[1]
    assert stream_records[2] == "someone_else: not flashrl's: \x1b[0m"  # another library's records are its own


def test_a_process_that_imports_flashrl_escapes_its_log_records(tmp_path):
    """The escaping is installed at import, as in each EnvRunner actor (whose log lines Ray forwards)."""
    script = ("import logging, sys\n"
              "logging.basicConfig(stream=sys.stdout, format='%(message)s')\n"
              "import flashrl.env_runners.rollout\n"
              f"logging.getLogger('flashrl.env_runners.rollout').warning('reward refused: %s', {OSC52!r})\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "reward refused: \\x1b]52;c;ZWNobyBwd25lZA==\\x07\n"
