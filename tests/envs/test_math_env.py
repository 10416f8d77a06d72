"""MathEnv: presets, generators, dataset sources with bad rows, rewards and episode end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashrl.envs  # noqa: F401  (registers the ids)
from flashrl.envs import EpisodeEndedError
from flashrl.envs.math import (
    ArithmeticGenerator,
    DatasetError,
    MathEnv,
    MathTask,
    PromptTemplate,
    WordProblemGenerator,
    from_records,
    load_jsonl,
    load_parquet,
)
from flashrl.envs.math.generators import evaluate


# --------------------------------------------------------------------------------------- presets
def test_easy_sums_preset_is_the_default() -> None:
    env = gym.make("flashrl/Math-v0")
    messages, info = env.reset(seed=0)
    match = re.fullmatch(r"What is (\d+) \+ (\d+)\?", messages[0]["content"])
    assert match and len(messages) == 1 and messages[0]["role"] == "user"
    a, b = int(match[1]), int(match[2])
    assert 1 <= a <= 30 and 1 <= b <= 30
    assert info["answer"] == str(a + b)
    assert info["prompt_id"] == f"arith:{a}+{b}"
    # The small model restates the question; the last number is its answer.
    new, reward, terminated, truncated, step_info = env.step(f"{a} + {b} = {a + b}")
    assert (new, reward, terminated, truncated) == ([], 1.0, True, False)
    assert step_info["correct"] and step_info["extracted"] == str(a + b) and step_info["reason"] == "correct"
    env.reset(seed=0)
    assert env.step(f"{a} + {b} = {a + b + 1}")[1] == 0.0
    env.close()


def test_step_after_the_end_raises() -> None:
    env = MathEnv()
    env.reset(seed=1)
    env.step("1")
    with pytest.raises(EpisodeEndedError):
        env.step("2")


def test_format_reward_is_added_for_a_boxed_answer() -> None:
    env = MathEnv(format_reward=0.25, template="boxed")
    _, info = env.reset(seed=3, options={"task": {"question": "What is 2 + 2?", "answer": "4"}})
    assert info["prompt_id"] == "custom:What is 2 + 2?"
    assert env.step("\\boxed{4}")[1] == 1.25
    env.reset(options={"task": {"question": "What is 2 + 2?", "answer": "4"}})
    assert env.step("\\boxed{5}")[1] == 0.25
    env.reset(options={"task": {"question": "What is 2 + 2?", "answer": "4"}})
    assert env.step("4")[1] == 1.0


def test_verifier_timeout_gives_zero_reward_and_is_counted() -> None:
    env = MathEnv(verify_timeout_s=1.0)
    env.reset(options={"task": MathTask("Big?", "1", "big")})
    _, reward, terminated, _, info = env.step("\\boxed{9^{9^{9^{9}}}}")
    assert reward == 0.0 and terminated
    assert info["verifier_failed"] and info["reason"].startswith("timeout")
    assert env.verifier_failures == 1


def test_templates_and_system_prompt() -> None:
    env = MathEnv(preset="arithmetic", system_prompt="Be brief.")
    messages, info = env.reset(seed=0)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["content"] == f"{info['question']}\nPut your final answer in \\boxed{{}}."
    env = MathEnv(template="Solve: {expression}. Answer:")
    messages, info = env.reset(seed=0)
    assert messages[0]["content"] == f"Solve: {info['question'][8:-1]}. Answer:"
    with pytest.raises(ValueError, match="Unknown template"):
        MathEnv(template="no_such_template")
    with pytest.raises(ValueError, match="must contain"):
        PromptTemplate("no placeholder")


def test_bad_configuration_errors() -> None:
    with pytest.raises(ValueError, match="Unknown preset"):
        MathEnv(preset="calculus")
    with pytest.raises(ValueError, match="at most one"):
        MathEnv(preset="easy_sums", difficulty=2)
    with pytest.raises(ValueError, match="difficulty must be one of"):
        MathEnv(difficulty=9)
    with pytest.raises(ValueError, match="Unknown reset options"):
        MathEnv().reset(options={"task_id": 3})
    with pytest.raises(ValueError, match="finite task source"):
        MathEnv().reset(options={"task_index": 0})


# --------------------------------------------------------------------------------------- generators
@settings(max_examples=60, deadline=None)
@given(level=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_arithmetic_answers_are_exact(level: int, seed: int) -> None:
    gen = ArithmeticGenerator.from_difficulty(level)
    task = gen.sample(np.random.default_rng(seed))
    expression = task.metadata["expression"]
    assert re.fullmatch(r"\d+( [-+*] \d+)+", expression)
    # eval of the printed expression (digits and + - * only, checked above) is the reference.
    assert int(task.answer) == eval(expression)
    assert int(task.answer) >= 0
    assert len(task.metadata["operands"]) == gen.num_operands
    assert all(gen.min_value <= x <= gen.max_value for x in task.metadata["operands"])
    assert task.prompt_id == "arith:" + expression.replace(" ", "")


def test_evaluate_precedence() -> None:
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([10, 2, 3, 4], ["-", "*", "+"]) == 8
    assert evaluate([5, 7], ["-"]) == -2


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.integers(2, 40))
def test_word_problems_have_non_negative_integer_answers(seed: int, scale: int) -> None:
    task = WordProblemGenerator(scale=scale).sample(np.random.default_rng(seed))
    numbers = [int(x) for x in re.findall(r"\d+", task.question)]
    assert int(task.answer) >= 0
    assert len(numbers) >= 3  # multi-step: at least three numbers combine into the answer
    assert task.prompt_id.startswith("word:" + task.metadata["template"])


def test_word_problem_answer_by_hand() -> None:
    rng = np.random.default_rng(0)
    gen = WordProblemGenerator(templates=("buy_and_give",))
    task = gen.sample(rng)
    a, b, c, d = task.metadata["numbers"]
    assert task.answer == str(a + b * c - d)
    assert f"{task.metadata['numbers'][0]} " in task.question


def test_generator_errors() -> None:
    with pytest.raises(ValueError, match="num_operands"):
        ArithmeticGenerator(num_operands=1)
    with pytest.raises(ValueError, match="operators"):
        ArithmeticGenerator(operators=("/",))
    with pytest.raises(ValueError, match="templates"):
        WordProblemGenerator(templates=("nope",))


# --------------------------------------------------------------------------------------- datasets
def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_with_custom_fields_and_gsm8k_answers(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "gsm.jsonl",
        [
            {"problem": "Tom has 3 cats and buys 2 more. How many?", "solution": "3+2=5\n#### 5", "uid": "a"},
            "",
            {"problem": "A box holds 1,200 nails. Two boxes?", "solution": "#### 2,400", "uid": "b"},
        ],
    )
    tasks = load_jsonl(
        path, question_field="problem", answer_field="solution", id_field="uid", answer_format="gsm8k"
    )
    assert [(t.prompt_id, t.answer) for t in tasks] == [("a", "5"), ("b", "2400")]
    assert tasks[1].metadata["source"] == f"{path}:3"
    env = gym.make(
        "flashrl/Math-v0",
        tasks=str(path),
        question_field="problem",
        answer_field="solution",
        answer_format="gsm8k",
        order="sequential",
    )
    messages, info = env.reset(seed=0)
    assert info["prompt_id"] == "gsm.jsonl:1" and info["task_index"] == 0
    assert messages[-1]["content"].startswith("Tom has 3 cats")
    assert env.step("Tom has 5 cats, \\boxed{5}")[1] == 1.0
    assert env.reset()[1]["prompt_id"] == "gsm.jsonl:3"
    assert env.reset()[1]["prompt_id"] == "gsm.jsonl:1"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"question": "q", "answer": ', r"bad\.jsonl:2: invalid JSON"),
        ('["q", "a"]', r"bad\.jsonl:2: expected an object with fields, got list"),
        (
            '{"question": "q"}',
            r"bad\.jsonl:2: missing field 'answer' \(the answer\); the row has fields \['question'\]",
        ),
        (
            '{"question": "q", "answer": null}',
            r"bad\.jsonl:2: field 'answer' \(the answer\) must be a string or a number; got NoneType",
        ),
        ('{"question": "  ", "answer": "1"}', r"bad\.jsonl:2: field 'question' \(the question\) is empty"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "ok", "answer": "1"}, row])
    with pytest.raises(DatasetError, match=message):
        load_jsonl(path)
    with pytest.raises(DatasetError, match=message):
        MathEnv(str(path))


def test_parquet_with_nested_fields(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "prompt": ["What is 6 * 7?", "What is 9 - 4?"],
            "reward_model": [{"ground_truth": "42"}, {"ground_truth": "5"}],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    tasks = load_parquet(path, question_field="prompt", answer_field="reward_model.ground_truth")
    assert [(t.question, t.answer, t.prompt_id) for t in tasks] == [
        ("What is 6 * 7?", "42", "train.parquet:1"),
        ("What is 9 - 4?", "5", "train.parquet:2"),
    ]
    env = MathEnv(path, question_field="prompt", answer_field="reward_model.ground_truth")
    assert env.reset(options={"task_index": 1})[1]["answer"] == "5"
    assert env.step("9 - 4 = 5")[1] == 1.0
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["q1", "q2"], "answer": ["1", None]}), bad)
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 2: field 'answer'"):
        load_parquet(bad, question_field="prompt")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        load_parquet(tmp_path / "junk.parquet")


def test_records_like_a_hf_dataset_and_epoch_shuffle() -> None:
    rows = [{"q": f"What is {i} + 1?", "a": i + 1} for i in range(5)]
    tasks = from_records(rows, question_field="q", answer_field="a", name="toy")
    assert tasks[4].answer == "5" and tasks[4].prompt_id == "toy:5"
    env = MathEnv(rows, question_field="q", answer_field="a")
    first = [env.reset(seed=7)[1]["prompt_id"]] + [env.reset()[1]["prompt_id"] for _ in range(4)]
    assert sorted(first) == [f"dataset:{i}" for i in range(1, 6)]  # one epoch: every task once
    again = [env.reset(seed=7)[1]["prompt_id"]] + [env.reset()[1]["prompt_id"] for _ in range(4)]
    assert again == first
    with pytest.raises(DatasetError, match=r"toy: row 2: missing field 'a'"):
        from_records([{"q": "x", "a": 1}, {"q": "y"}], question_field="q", answer_field="a", name="toy")


# ------------------------------------------------------------------------------------- benchmarks
MIXED = [
    {"question": "What is 1 + 1?", "answer": "2", "datasource": "gsm8k"},
    {"question": "What is 2 + 2?", "answer": "4", "datasource": "aime25"},
    {"question": "What is 3 + 3?", "answer": "6"},  # no benchmark: the episode info has none
]


def test_a_rows_datasource_is_in_the_reset_and_step_info(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "eval.jsonl", MIXED)
    assert [t.info for t in load_jsonl(path)] == [{"datasource": "gsm8k"}, {"datasource": "aime25"}, {}]
    env = gym.make("flashrl/Math-v0", tasks=str(path), order="sequential")
    infos = []
    for index, reply in enumerate(["2", "5", "6"]):
        _, reset_info = env.reset(options={"task_index": index})
        infos.append((reset_info.get("datasource"), env.step(reply)[4].get("datasource")))
    assert infos == [("gsm8k", "gsm8k"), ("aime25", "aime25"), (None, None)]
    # verl's spelling is read too, under its own name (evaluation_datasource_key's default)
    env = MathEnv([{"question": "q", "answer": "1", "data_source": "math500"}])
    assert env.reset(seed=0)[1]["data_source"] == "math500" and env.step("1")[4]["data_source"] == "math500"
    task = {"question": "What is 5 + 5?", "answer": "10", "datasource": "amc23"}
    assert env.reset(options={"task": task})[1]["datasource"] == "amc23"


def test_a_named_datasource_field_is_required_and_may_be_nested(tmp_path: Path) -> None:
    rows = [{"question": "q1", "answer": "1", "extra": {"bench": "minerva"}},
            {"question": "q2", "answer": "2", "extra": {"bench": 2025}}]
    tasks = from_records(rows, datasource_field="extra.bench", name="toy")
    assert [t.info for t in tasks] == [{"extra.bench": "minerva"}, {"extra.bench": "2025"}]
    missing = r"toy: row 2: missing field 'extra.bench' \(the datasource\).*Set datasource_field="
    with pytest.raises(DatasetError, match=missing):
        from_records([rows[0], {"question": "q", "answer": "1"}], datasource_field="extra.bench", name="toy")
    with pytest.raises(DatasetError, match=r"row 1: field 'datasource' \(the datasource\) is empty"):
        from_records([{"question": "q", "answer": "1", "datasource": " "}])


def test_a_null_datasource_in_parquet_is_no_datasource(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "eval.parquet"
    table = pa.table({"question": ["q1", "q2"], "answer": ["1", "2"], "datasource": ["aime24", None]})
    pq.write_table(table, path)
    env = MathEnv(path, order="sequential")
    assert env.reset(seed=0)[1]["datasource"] == "aime24"
    assert "datasource" not in env.reset()[1]


def test_pandas_dataframe() -> None:
    import pandas as pd

    frame = pd.DataFrame({"question": ["What is 2 * 21?", "What is 1 + 1?"], "answer": [42, 2]})
    env = MathEnv(frame, order="sequential")
    assert env.reset(seed=0)[1]["prompt_id"] == "dataframe:1"
    assert env.step("2 * 21 = 42")[1] == 1.0


def test_unsupported_sources() -> None:
    with pytest.raises(FileNotFoundError):
        MathEnv("does_not_exist.jsonl")
    with pytest.raises(TypeError, match="tasks must be"):
        MathEnv(42)
