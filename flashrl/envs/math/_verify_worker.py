"""Verification worker process: runs ``math_verify`` on requests read from stdin, one JSON per line.

Started by :mod:`flashrl.envs.math.verifier` as ``python _verify_worker.py``; it imports nothing from
flashrl, so it starts the same way whatever the install mode. Protocol (one JSON object per line):

* on start, after the imports: ``{"ready": true}``
* request ``{"gold": str, "pred": str, "kill_after_s": float}``: ``gold`` is the reference answer
  (LaTeX or plain), ``pred`` the answer already extracted from the model's reply (the content of its
  ``\\boxed{}`` or the last number of the reply); past ``kill_after_s`` the worker ends itself (the
  parent normally kills it sooner, at its own time limit).
* reply ``{"correct": bool, "gold_parsed": str | null, "pred_parsed": str | null, "error": str | null}``

The worker runs math_verify with its own (signal based) time limits disabled: the parent enforces the
time limit by killing this process, which also stops a sympy computation that never returns. The
worker exits when its stdin closes (the parent went away).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys


def _main() -> None:
    # Python put this file's folder first on sys.path; its module names (env, tasks, ...) must not
    # shadow anything math_verify or sympy import.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    # The protocol owns the original stdout; anything a library prints goes to stderr instead.
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    logging.disable(logging.WARNING)

    from math_verify import parse, verify

    def parse_answer(text: str) -> list:
        # \boxed{...} makes math_verify read the text as LaTeX (fractions, roots, pi) and as a plain
        # expression (1/2, 0.5) alike.
        return parse("\\boxed{" + text + "}", parsing_timeout=None, raise_on_error=True)

    # Backstop for a parent that died while a request runs (an idle worker exits on stdin EOF): the
    # default action of SIGALRM ends the process even inside a C call that holds the GIL.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    protocol.write(json.dumps({"ready": True}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        reply: dict = {"correct": False, "gold_parsed": None, "pred_parsed": None, "error": None}
        try:
            request = json.loads(line)
            signal.alarm(max(1, math.ceil(float(request.get("kill_after_s", 60.0)))))
            gold = parse_answer(request["gold"])
            reply["gold_parsed"] = str(gold[0]) if gold else None
            if not gold:
                reply["error"] = f"gold answer {request['gold']!r} could not be parsed"
            else:
                pred = parse_answer(request["pred"])
                reply["pred_parsed"] = str(pred[0]) if pred else None
                if pred:
                    reply["correct"] = bool(verify(gold, pred, timeout_seconds=None, raise_on_error=True))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which counts it
            reply["error"] = f"{type(exc).__name__}: {exc}"[:500]
        signal.alarm(0)
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


if __name__ == "__main__":
    _main()
