"""Dataset files that are wrong fail loudly: encoding, non-finite answers, repeated task ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrl.envs.math.tasks import DatasetError, MathTask, TaskList, from_records, load_jsonl, load_tasks


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_a_non_utf8_line_names_the_file_line_and_byte(tmp_path: Path) -> None:
    good = json.dumps({"question": "1 + 1?", "answer": "2"}).encode()
    bad = b'{"question": "caf\xe9?", "answer": "3"}'  # Latin-1 e-acute
    path = write(tmp_path / "tasks.jsonl", [good, b"", bad])
    with pytest.raises(DatasetError, match=r"tasks\.jsonl:3: not UTF-8 \(byte 0xe9 at column 18\); expected a "
                       r"UTF-8 JSON Lines file"):
        load_tasks(str(path))


def test_utf8_text_still_loads(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [json.dumps({"question": "café + π?", "answer": "2"}, ensure_ascii=False)
                                        .encode()])
    (task,) = load_jsonl(path)
    assert (task.question, task.answer, task.prompt_id) == ("café + π?", "2", "t.jsonl:1")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_answer_is_an_error(tmp_path: Path, literal: str) -> None:
    path = write(tmp_path / "t.jsonl", [b'{"question": "q", "answer": ' + literal.encode() + b"}"])
    with pytest.raises(DatasetError, match=r"t\.jsonl:1: field 'answer' \(the answer\) is the number "
                       r"-?(nan|inf); expected a finite number or text"):
        load_jsonl(path)


def test_non_finite_numbers_from_records_are_errors_too() -> None:
    with pytest.raises(DatasetError, match=r"rows: row 2: field 'answer' \(the answer\) is the number nan"):
        from_records([{"question": "a", "answer": 1.5}, {"question": "b", "answer": float("nan")}], name="rows")
    # The text 'nan' is text (an answer may be a word); only the number is refused.
    assert from_records([{"question": "a", "answer": "nan"}])[0].answer == "nan"


def test_duplicate_ids_are_an_error_naming_both_rows(tmp_path: Path) -> None:
    rows = [{"id": "a", "question": "q1", "answer": "1"}, {"id": "b", "question": "q2", "answer": "2"},
            {"id": "a", "question": "q3", "answer": "3"}]
    path = write(tmp_path / "t.jsonl", [json.dumps(r).encode() for r in rows])
    with pytest.raises(DatasetError, match=rf"task id 'a' appears twice \({path}:1 and {path}:3\); expected "
                       "every id once.*allow_duplicate_ids=True"):
        load_tasks(str(path), id_field="id")
    tasks = load_tasks(str(path), id_field="id", allow_duplicate_ids=True)
    assert [t.prompt_id for t in tasks] == ["a", "b", "a"]


def test_duplicate_ids_in_a_task_list() -> None:
    same = [MathTask("q", "1", "x"), MathTask("r", "2", "x")]
    with pytest.raises(DatasetError, match=r"task id 'x' appears twice \(item 0 and item 1\)"):
        TaskList(same)
    with pytest.raises(DatasetError, match="appears twice"):
        load_tasks(same)
    assert len(TaskList(same, allow_duplicate_ids=True)) == 2


def test_a_5000_digit_integer_names_the_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"question": "1 + 1?", "answer": "2"}).encode()
    path = write(tmp_path / "big.jsonl", [good, b'{"question": "q", "answer": ' + b"7" * 5000 + b"}"])
    with pytest.raises(DatasetError, match=r"big\.jsonl:2: a number Python does not read \(Exceeds the limit \(4300 "
                       r"digits\) .*\); expected numbers of at most 4300 digits\. Write a longer number as a JSON string\."):
        load_tasks(str(path))
    # As a string it is an answer like any other.
    path = write(tmp_path / "big_text.jsonl", [b'{"question": "q", "answer": "' + b"7" * 5000 + b'"}'])
    assert load_jsonl(path)[0].answer == "7" * 5000


def test_a_100k_deep_row_names_the_file_and_line(tmp_path: Path) -> None:
    deep = b'{"question": "q", "answer": "1", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = write(tmp_path / "deep.jsonl", [deep])
    with pytest.raises(DatasetError, match=r"deep\.jsonl:1: JSON nested deeper than Python's parser goes \(its "
                       r"recursion limit, \d+\); expected a row of fields\. Fix or drop the row\."):
        load_jsonl(path)


def test_a_5000_digit_integer_in_a_row_names_the_row() -> None:
    """Rows built in Python (a list of dicts, a datasets.Dataset, a Parquet file's rows) name their row."""
    rows = [{"question": "1 + 1?", "answer": 2}, {"question": "q", "answer": 7 * 10**4999}]
    with pytest.raises(DatasetError, match=r"^dataset: row 2: field 'answer' \(the answer\) is an integer of more "
                       r"than 4300 digits, which Python does not write as text\. Give it as a string\.$"):
        from_records(rows)
