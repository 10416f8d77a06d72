r"""Answer checking with the ``math-verify`` package, under a time limit that works in any thread.

:func:`verify_answer` turns a model reply and a reference answer into a :class:`VerifyResult`:

1. **Extraction** (in this process, pure string scanning that cannot hang):
   * the content of the **last complete** ``\boxed{...}`` (or ``\fbox{...}``) in the reply, braces
     balanced; otherwise
   * the **fallback**: the **last number** in the reply (integers, decimals, ``1,000``-style thousands,
     simple fractions ``3/4``; a leading ``-`` counts when it is not a binary minus such as ``3-5``).
     Small models restate the question ("23 + 45 = 78"), so the last number, not the first, is the
     answer. Anything else (expressions, sets, intervals) must be boxed to be checked.
2. **Not an answer**: a boxed content that is only numbers joined by arithmetic operators
   (``86 * 26``, ``23 + 45``, ``9 \times 7``, ``12 - 5 + 1``) is the question restated, not its
   result: reason ``unevaluated_expression``, reward 0. math-verify would evaluate it and call it equal,
   so a model that copies "What is 86 * 26?" into ``\boxed{86 * 26}`` would be paid for every
   arithmetic question. A single number (``-5``, ``1,000``, ``3.5``), a simple fraction (``3/4``,
   ``\frac{3}{4}``) and anything with a symbol (``2\sqrt{3}``, ``x + 1``) are checked as before.
3. **Comparison** with ``math_verify.parse`` + ``math_verify.verify`` (symbolic and numeric equality:
   ``\frac{1}{2}`` equals ``0.5``) in a **worker process**.

Why a worker process: math-verify's own time limit uses ``signal.alarm``, which only works in the main
thread of the main interpreter, while EnvRunners call environments from threads and event loops; and
a thread cannot be interrupted inside a sympy computation. The worker (a plain ``python`` subprocess,
started on first use, so it is safe in processes that already run threads) answers one request at a
time; when a request exceeds ``timeout_s`` the worker is killed and replaced. A request costs well
under a millisecond of overhead; the first one pays the worker start (about 1.5 s, mostly importing
sympy). Workers exit with their parent. :func:`configure_verifier` (or the environment variable
``FLASHRL_VERIFIER_WORKERS``, default 1) sets how many run in parallel.

A timeout or a crash never raises: it gives reward 0, ``correct=False`` and a ``reason`` that starts
with ``"timeout"`` or ``"error"``, and increments the process-wide counters of :func:`verifier_stats`.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_verify_worker.py")
_WORKER_START_TIMEOUT_S = 120.0
_MAX_LINE_BYTES = 1 << 20
_KILL_GRACE_S = 5.0  # a worker ends itself this long after a request's time limit (orphan backstop)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of checking one reply against its reference answer."""

    reward: float
    """1.0 when the extracted answer equals the reference, else 0.0."""
    correct: bool
    """Whether the extracted answer equals the reference."""
    extracted: str | None
    """The answer taken from the reply (boxed content or last number); None when there was none."""
    reason: str
    """``correct``, ``wrong``, ``no_answer``, ``unevaluated_expression``, ``unparsable_answer``, or
    ``timeout...``/``error...``."""
    boxed: bool = False
    """Whether the answer came from a complete ``\\boxed{}`` (the format the prompts ask for)."""

    @property
    def failed(self) -> bool:
        """Whether verification itself failed (timeout or crash), as opposed to a wrong answer."""
        return self.reason.startswith(("timeout", "error"))


# --------------------------------------------------------------------------------------- extraction
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_CLOSE_OR_BOX_RE = re.compile(r"\}|" + _BOX_RE.pattern)
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]}])-)?"  # a minus sign, unless it follows an operand (then it is binary)
    r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 1,000 or 1000, optional decimals
    r"(?:/\d+)?"  # optional simple fraction
    r"(?![\d])"
)
_PLAIN_NUMBER = r"-?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_OPERATOR = r"(?:[-+*/x\u00d7\u00f7\u00b7]|\\times|\\cdot|\\div|\\ast)"
_UNEVALUATED_RE = re.compile(
    rf"\s*\(?\s*{_PLAIN_NUMBER}\s*\)?(?:\s*{_OPERATOR}\s*\(?\s*{_PLAIN_NUMBER}\s*\)?)+\s*"
)
_SIMPLE_FRACTION_RE = re.compile(r"\s*-?\s*\d+\s*/\s*\d+\s*")


def is_unevaluated_expression(answer: str) -> bool:
    """Whether ``answer`` is only plain numbers joined by arithmetic operators (``86 * 26``): the
    question restated, not its result. A simple fraction ``a/b`` is a number, not an expression."""
    return bool(_UNEVALUATED_RE.fullmatch(answer)) and not _SIMPLE_FRACTION_RE.fullmatch(answer)


def extract_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}``/``\fbox{...}`` in ``text`` (None if none).

    "Last" is the box that opens last among those whose brace is closed (``\boxed{\boxed{1}}`` gives
    ``1``). One pass, linear in the text even for thousands of nested or unbalanced braces (a scan
    from every box to its closing brace, as before, was quadratic: 6.7 s for 28k characters). Outside
    every box, braces cannot matter; inside one, the opening braces up to the next ``}`` or box are
    counted by ``str.count``, so Python-level steps happen only at ``}`` and boxes.
    """
    best_start, best_end = -1, -1
    starts: list[int] = []  # the open boxes' content starts, innermost last
    depths: list[int] = []  # per open box: its plain "{" still open inside it
    count = text.count
    pos = 0
    for match in _CLOSE_OR_BOX_RE.finditer(text):
        if not starts:
            if match.group() != "}":  # a "}" outside every box cannot matter
                starts.append(match.end())
                depths.append(0)
            pos = match.end()
            continue
        depth = depths[-1] + count("{", pos, match.start())
        pos = match.end()
        if match.group() != "}":
            depths[-1] = depth
            starts.append(pos)
            depths.append(0)
        elif depth:
            depths[-1] = depth - 1
        else:
            start = starts.pop()
            depths.pop()
            if start > best_start:
                best_start, best_end = start, match.start()
    return text[best_start:best_end].strip() if best_start >= 0 else None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text``, thousands separators removed (None if there is none)."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(text: str) -> tuple[str | None, bool]:
    r"""``(answer, boxed)``: the last complete ``\boxed{}`` content, else the last number."""
    boxed = extract_boxed(text)
    if boxed:
        return boxed, True
    return extract_last_number(text), False


# --------------------------------------------------------------------------------------- counters
class _Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = {"calls": 0, "correct": 0, "timeouts": 0, "errors": 0, "worker_starts": 0}

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n


_STATS = _Stats()


def verifier_stats() -> dict[str, int]:
    """Process-wide counts: ``calls``, ``correct``, ``timeouts``, ``errors``, ``worker_starts``."""
    with _STATS._lock:
        return dict(_STATS.counts)


# --------------------------------------------------------------------------------------- workers
class VerifierTimeout(Exception):
    """The worker did not answer within the time limit (it has been killed)."""


class VerifierCrash(Exception):
    """The worker exited or answered garbage (it has been discarded)."""


class _Worker:
    """One ``_verify_worker.py`` subprocess speaking JSON lines over its stdin/stdout."""

    def __init__(self) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise VerifierCrash("the math-verify package is not installed: pip install 'math-verify>=0.8'")
        _STATS.add("worker_starts")
        self.proc = subprocess.Popen(
            [sys.executable, _WORKER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C in the parent's terminal does not kill it mid-request
        )
        self._buffer = b""
        try:
            ready = self._read_line(_WORKER_START_TIMEOUT_S)
        except VerifierTimeout as exc:
            raise VerifierCrash(f"verifier worker did not start: {exc}") from exc
        if ready != '{"ready": true}':
            self.kill()
            raise VerifierCrash(f"verifier worker sent {ready[:200]!r} instead of its ready line")

    def request(self, gold: str, pred: str, timeout_s: float) -> dict:
        assert self.proc.stdin is not None
        try:
            request = {"gold": gold, "pred": pred, "kill_after_s": timeout_s + _KILL_GRACE_S}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self.kill()
            raise VerifierCrash(f"verifier worker exited (code {self.proc.poll()}): {exc}") from exc
        line = self._read_line(timeout_s)
        try:
            return json.loads(line)
        except ValueError as exc:
            self.kill()
            raise VerifierCrash(f"verifier worker sent {line[:200]!r}, not JSON") from exc

    def _read_line(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise VerifierTimeout(f"no answer within {timeout_s:g} s")
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                self.kill()
                raise VerifierCrash(f"verifier worker exited (code {self.proc.poll()})")
            self._buffer += chunk
            if len(self._buffer) > _MAX_LINE_BYTES:
                self.kill()
                raise VerifierCrash("verifier worker sent an over-long line")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8", errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class _Pool:
    """Up to ``max_workers`` workers, started lazily; a killed worker is replaced on next use."""

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(max_workers)
        self._all: list[_Worker] = []
        self._lock = threading.Lock()

    def run(self, gold: str, pred: str, timeout_s: float) -> dict:
        with self._slots:
            worker = None
            while worker is None:
                try:
                    worker = self._idle.get_nowait()
                except queue.Empty:
                    worker = _Worker()
                    with self._lock:
                        self._all.append(worker)
                if not worker.alive:  # died while idle (e.g. the OOM killer): not this request's fault
                    self._discard(worker)
                    worker = None
            try:
                return worker.request(gold, pred, timeout_s)
            finally:
                if worker.alive:
                    self._idle.put(worker)
                else:
                    self._discard(worker)

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
        for worker in workers:
            worker.kill()

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._all if w.alive]


_POOL = _Pool(max_workers=int(os.environ.get("FLASHRL_VERIFIER_WORKERS", "1")))
atexit.register(lambda: _POOL.close())


def configure_verifier(*, max_workers: int) -> None:
    """Set how many verification worker processes may run at once (stops the current ones)."""
    global _POOL
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1; got {max_workers}.")
    old, _POOL = _POOL, _Pool(max_workers)
    old.close()


def verifier_worker_pids() -> list[int]:
    """Process ids of the live verification workers (for tests and monitoring)."""
    return _POOL.worker_pids()


# --------------------------------------------------------------------------------------- entry point
def verify_answer(response_text: str, gold_answer: str, *, timeout_s: float = 5.0) -> VerifyResult:
    r"""Check ``response_text`` against ``gold_answer``; never raises for a bad reply.

    Args:
        response_text: The model's reply.
        gold_answer: The reference answer, LaTeX (``\frac{1}{2}``) or plain (``0.5``, ``78``).
        timeout_s: Wall-clock limit for the comparison; past it the result is a counted timeout.

    Returns:
        A :class:`VerifyResult`; ``reward`` is 1.0 exactly when ``correct``.
    """
    if not isinstance(response_text, str) or not isinstance(gold_answer, str):
        raise TypeError(
            "verify_answer expects (response_text: str, gold_answer: str); got "
            f"({type(response_text).__name__}, {type(gold_answer).__name__})."
        )
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0; got {timeout_s}.")
    _STATS.add("calls")
    extracted, boxed = extract_answer(response_text)
    if extracted is None:
        return VerifyResult(0.0, False, None, "no_answer", boxed)
    if is_unevaluated_expression(extracted):
        return VerifyResult(0.0, False, extracted, "unevaluated_expression", boxed)
    try:
        reply = _POOL.run(gold_answer, extracted, timeout_s)
    except VerifierTimeout as exc:
        _STATS.add("timeouts")
        return VerifyResult(0.0, False, extracted, f"timeout: {exc}", boxed)
    except (VerifierCrash, OSError, ValueError) as exc:
        _STATS.add("errors")
        return VerifyResult(0.0, False, extracted, f"error: {exc}", boxed)
    if reply.get("error"):
        _STATS.add("errors")
        return VerifyResult(0.0, False, extracted, f"error: {reply['error']}", boxed)
    if reply.get("pred_parsed") is None:
        return VerifyResult(0.0, False, extracted, "unparsable_answer", boxed)
    if reply.get("correct"):
        _STATS.add("correct")
        return VerifyResult(1.0, True, extracted, "correct", boxed)
    return VerifyResult(0.0, False, extracted, "wrong", boxed)
