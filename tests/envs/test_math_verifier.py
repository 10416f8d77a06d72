"""The math-verify based verifier: extraction, equivalence, time limit off the main thread, crashes."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashrl.envs.math.verifier import (
    extract_answer,
    extract_boxed,
    extract_last_number,
    is_unevaluated_expression,
    verifier_stats,
    verifier_worker_pids,
    verify_answer,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("23 + 45 = 78", ("78", False)),
        ("The sum of 23 and 45 is 78.", ("78", False)),
        ("10 - 15 = -5.", ("-5", False)),
        ("3-5", ("5", False)),  # a binary minus is not a sign
        ("We get 1,234,567 in total", ("1234567", False)),
        ("half: 1/2", ("1/2", False)),
        ("pi is about 3.14159!", ("3.14159", False)),
        ("first 7 then \\boxed{12} and 99 later", ("12", True)),
        ("\\boxed{1} then \\boxed{\\frac{3}{4}}", ("\\frac{3}{4}", True)),
        ("\\boxed{ {a} + {b} }", ("{a} + {b}", True)),
        ("\\fbox{9}", ("9", True)),
        ("truncated \\boxed{12", ("12", False)),  # no complete box: the last number
        ("no digits here", (None, False)),
        ("", (None, False)),
    ],
)
def test_extract_answer(text: str, expected: tuple[str | None, bool]) -> None:
    assert extract_answer(text) == expected


def test_extract_helpers() -> None:
    assert extract_boxed("\\boxed{}") == ""  # an empty box is found, and empty
    assert extract_answer("12 then \\boxed{}") == ("12", False)  # ... so the answer falls back
    assert extract_boxed("\\boxed {x}") == "x"
    assert extract_last_number("v2 of 3") == "3"
    assert extract_last_number("(-4)") == "-4"


@pytest.mark.parametrize(
    ("reply", "gold", "correct", "reason"),
    [
        ("23 + 45 = 78", "78", True, "correct"),
        ("23 + 45 = 77", "78", False, "wrong"),
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", True, "correct"),
        ("\\boxed{0.5}", "\\frac{1}{2}", True, "correct"),
        ("\\boxed{\\sqrt{4}}", "2", True, "correct"),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", True, "correct"),
        ("\\boxed{2\\pi}", "\\pi", False, "wrong"),
        ("It is 1,000 apples", "1000", True, "correct"),
        ("I do not know", "5", False, "no_answer"),
        # the question restated in the box is not its result, though math-verify would evaluate it
        ("\\boxed{86 * 26}", "2236", False, "unevaluated_expression"),
        ("\\boxed{23 + 45}", "68", False, "unevaluated_expression"),
        ("\\boxed{9 \\times 7}", "63", False, "unevaluated_expression"),
        ("\\boxed{(12 - 5) + 1}", "8", False, "unevaluated_expression"),
        ("\\boxed{-2236}", "-2236", True, "correct"),
        ("\\boxed{3/4}", "0.75", True, "correct"),
        ("\\boxed{2:1}", "2:1", True, "correct"),
        ("\\boxed{2\\sqrt{3} + 1}", "1 + 2\\sqrt{3}", True, "correct"),
    ],
)
def test_verify_answer(reply: str, gold: str, correct: bool, reason: str) -> None:
    result = verify_answer(reply, gold)
    assert (result.correct, result.reason) == (correct, reason)
    assert result.reward == (1.0 if correct else 0.0)
    assert not result.failed


@pytest.mark.parametrize(
    ("answer", "unevaluated"),
    [("86 * 26", True), ("86*26", True), ("3 x 4", True), ("1,000 + 2", True), ("7 \u00d7 8", True),
     ("12 \\div 4", True), ("(3) \\cdot (4)", True), ("-5", False), ("1,000", False), ("3.5", False),
     ("3/4", False), ("-3 / 4", False), ("\\frac{3}{4}", False), ("x + 1", False), ("10^2", False),
     ("2:1", False), ("1, 2", False), ("86 * 26 = 2236", False)],
)
def test_unevaluated_expressions(answer: str, unevaluated: bool) -> None:
    assert is_unevaluated_expression(answer) is unevaluated


def test_boxed_answer_wins_over_a_later_number() -> None:
    result = verify_answer("\\boxed{78} because 23 + 45 = 78 and 2 more", "78")
    assert (result.correct, result.extracted, result.boxed) == (True, "78", True)


def test_bad_arguments_raise() -> None:
    with pytest.raises(TypeError, match="response_text: str"):
        verify_answer(None, "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        verify_answer("1", "1", timeout_s=0)


def test_works_from_many_threads_at_once() -> None:
    """math-verify's own signal-based timeout fails off the main thread; ours does not."""
    cases = [(f"{a} + {a} = {2 * a + (a % 2)}", str(2 * a)) for a in range(24)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: verify_answer(*c), cases))
    assert [r.correct for r in results] == [a % 2 == 0 for a in range(24)]
    assert not any(r.failed for r in results)


def test_timeout_off_the_main_thread_is_counted_and_recovers() -> None:
    verify_answer("1", "1")  # the worker is up
    before = verifier_stats()
    out: list = []
    # 9^(9^(9^9)) makes sympy compute for minutes; the worker is killed after 1 s.
    thread = threading.Thread(
        target=lambda: out.append(verify_answer("\\boxed{9^{9^{9^{9}}}}", "1", timeout_s=1.0))
    )
    start = time.monotonic()
    thread.start()
    thread.join(timeout=30)
    elapsed = time.monotonic() - start
    (result,) = out
    assert result.reward == 0.0 and not result.correct
    assert result.reason.startswith("timeout") and result.failed
    assert result.extracted == "9^{9^{9^{9}}}"
    assert elapsed < 10
    after = verifier_stats()
    assert after["timeouts"] == before["timeouts"] + 1
    assert after["calls"] == before["calls"] + 1
    assert verify_answer("4 + 4 = 8", "8").correct  # a fresh worker took over


def test_worker_crash_mid_request_is_counted_and_recovers() -> None:
    verify_answer("1", "1")
    (pid,) = verifier_worker_pids()
    out: list = []
    thread = threading.Thread(
        target=lambda: out.append(verify_answer("\\boxed{9^{9^{9^{9}}}}", "1", timeout_s=60.0))
    )
    before = verifier_stats()
    thread.start()
    time.sleep(0.5)  # the worker is now busy with the huge power
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=30)
    (result,) = out
    assert result.reward == 0.0 and result.reason.startswith("error") and result.failed
    assert "exited" in result.reason
    after = verifier_stats()
    assert after["errors"] == before["errors"] + 1 and after["timeouts"] == before["timeouts"]
    assert verify_answer("\\boxed{3}", "3").correct
    assert verifier_worker_pids() != [pid]


def test_worker_that_died_idle_is_replaced_silently() -> None:
    verify_answer("1", "1")
    (pid,) = verifier_worker_pids()
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    before = verifier_stats()
    assert verify_answer("\\boxed{3}", "3").correct
    after = verifier_stats()
    assert after["errors"] == before["errors"] and after["worker_starts"] == before["worker_starts"] + 1


def test_unparsable_gold_is_an_error_not_a_wrong_answer() -> None:
    before = verifier_stats()["errors"]
    result = verify_answer("\\boxed{3}", "")
    assert result.failed and result.reason.startswith("error")
    assert verifier_stats()["errors"] == before + 1


def test_orphaned_busy_worker_ends_itself() -> None:
    """If the parent dies mid-request, the worker's own alarm ends it (an idle one exits on EOF)."""
    import json
    import subprocess
    import sys

    from flashrl.envs.math import verifier

    proc = subprocess.Popen(
        [sys.executable, verifier._WORKER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == '{"ready": true}'
        proc.stdin.write(json.dumps({"gold": "1", "pred": "9^{9^{9^{9}}}", "kill_after_s": 1}) + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == -signal.SIGALRM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    idle = subprocess.Popen(
        [sys.executable, verifier._WORKER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert idle.stdout.readline().strip() == b'{"ready": true}'
    idle.stdin.close()
    assert idle.wait(timeout=30) == 0
