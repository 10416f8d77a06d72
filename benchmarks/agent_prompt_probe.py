"""Does the untrained model make native tool calls? The agent job's first call under four prompts.

SmolLM2-135M-Instruct has no tool-call format of its own: its chat template ignores `tools`, so the
endpoint writes the Hermes tool description into the system message (`flashrl.tool_calls`). Whether
the model then answers with `<tool_call>` blocks depends on what the agent's messages show it. Four
first calls of `benchmarks/agent_tool_job.py`'s agent, rendered exactly as the endpoint
renders them (`flashrl.agents.recorder.CallRecorder`, the agent's `TOOLS`):

* `system_one_shot`: the agent's first prompt (as the demo first shipped): the tool job's one-shot
  text with the call written as a `<tool_call>` block, all in the system message, no examples as turns;
* `examples_1`, `examples_2`, `examples_3`: the agent's short system prompt, then 1, 2 or 3 worked
  examples as real chat turns (question, native tool call, tool output, boxed answer); the job ships 2.

Each is sampled `--samples-per-question` times on the first `--questions` held-out products at the
job's temperature with transformers' `generate` (float32, seed 0; the same ids as the endpoint would
send vLLM, not vLLM itself). Counted per sample: a parsed native tool call, a call whose code is
`print(a * b)` for the question's a and b, a direct answer that is already correct, and a direct
answer that boxes an arithmetic expression worth the right result (`\\boxed{86 * 26}`: the verifier
refuses it as `unevaluated_expression`; before that refusal, math-verify paid it as correct).

    python benchmarks/agent_prompt_probe.py          # about 3 minutes on 2 cores; writes benchmarks/results/agent_prompt_probe.json
    python benchmarks/agent_prompt_probe.py --quick  # smoke: the tiny random model, 1 product x 2 samples of 8 tokens, a temp file
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _configs import benchmark_model
from _repo import RESULTS, load_script
from _reports import machine, table, write_json

from flashrl.agents.protocol import _message, reply_message
from flashrl.agents.recorder import CallRecorder
from flashrl.envs.math.verifier import extract_answer, is_unevaluated_expression, verify_answer

SYSTEM_ONE_SHOT = (
    "You can call a python tool that runs code in a fresh interpreter without network access and returns what "
    "it printed (use print). When you know the answer, reply with the final answer in \\boxed{} and no tool "
    "call.\n\nExample.\nUser: What is 37 * 64?\nAssistant:\n<tool_call>\n"
    '{"name": "python", "arguments": {"code": "print(37 * 64)"}}\n</tool_call>\n'
    "Tool: Exit status: 0\nstdout:\n```\n2368\n```\nAssistant: \\boxed{2368}"
)
"""The agent's system prompt as the demo first shipped it (the tool job's one-shot, the call as a native one)."""
EXTRA_EXAMPLE = (88, 73)
"""The third worked example of `examples_3` (in neither the training nor the held-out products)."""


def expression_value(answer: str) -> float | None:
    """The value of an unevaluated arithmetic answer (``86 * 26``, ``9 \\times 7``), else None."""
    if not is_unevaluated_expression(answer):
        return None
    python = answer.replace(",", "")
    for op, py in (("\\times", "*"), ("\\cdot", "*"), ("\\ast", "*"), ("\\div", "/"), ("\u00d7", "*"),
                   ("\u00f7", "/"), ("\u00b7", "*"), ("x", "*")):
        python = python.replace(op, py)
    if not re.fullmatch(r"[0-9.+\-*/() ]+", python):
        return None
    try:
        return float(eval(python, {"__builtins__": {}}))  # digits, operators and parentheses only (checked)
    except (SyntaxError, ZeroDivisionError):
        return None


def prompts(job: object, question: str) -> dict[str, list[dict]]:
    """The first call's messages under each prompt."""
    examples = [job.worked_example(37, 64), job.worked_example(52, 19), job.worked_example(*EXTRA_EXAMPLE)]
    out = {"system_one_shot": [{"role": "system", "content": SYSTEM_ONE_SHOT}, {"role": "user", "content": question}]}
    for n in (1, 2, 3):
        shots = [m for example in examples[:n] for m in example]
        out[f"examples_{n}"] = [{"role": "system", "content": job.SYSTEM_PROMPT}, *shots,
                                {"role": "user", "content": question}]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--samples-per-question", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--output", default=None, help="default: benchmarks/results/agent_prompt_probe.json "
                        "(--quick: a file in the system temp folder)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="the tiny random model, 1 product x 2 samples of 8 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.questions, args.samples_per_question, args.max_new_tokens = "tiny", 1, 2, 8
    if args.output is None:
        folder = Path(tempfile.gettempdir()) if args.quick else RESULTS
        args.output = str(folder / "agent_prompt_probe.json")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = load_script("benchmarks/agent_tool_job.py", "flashrl_bench_agent_job")
    _, held_out = job.products()
    with tempfile.TemporaryDirectory(prefix="flashrl_probe_") as folder:  # holds the tiny model, if asked for
        path = benchmark_model(args.model, folder)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    rows: dict[str, dict] = {}
    start = time.perf_counter()
    for task in held_out[: args.questions]:
        a, b = (int(x) for x in re.findall(r"\d+", task["question"]))
        for name, messages in prompts(job, task["question"]).items():
            recorder = CallRecorder(tokenizer, prompt_id=task["id"], max_episode_tokens=2048)
            ids = list(recorder.prompt([_message(m, i) for i, m in enumerate(messages)], job.TOOLS).ids)
            batch = torch.tensor([ids] * args.samples_per_question)
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True,
                                 temperature=job.TEMPERATURE, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens,
                                 pad_token_id=tokenizer.eos_token_id)
            row = rows.setdefault(name, {"prompt_tokens": len(ids), "samples": 0, "tool_calls": 0,
                                         "right_code": 0, "direct_correct": 0, "boxed_question": 0,
                                         "examples": []})
            for sample in out:
                text = tokenizer.decode(sample[len(ids):], skip_special_tokens=True)
                reply = reply_message(text, parse_tools=True, call_index=0)
                codes = [json.loads(c.arguments).get("code") for c in reply.tool_calls]
                row["samples"] += 1
                row["tool_calls"] += bool(reply.tool_calls)
                row["right_code"] += any(c is not None and c.replace(" ", "") == f"print({a}*{b})" for c in codes)
                row["direct_correct"] += not reply.tool_calls and verify_answer(text, task["answer"]).reward == 1.0
                extracted, _ = extract_answer(text)
                row["boxed_question"] += (not reply.tool_calls and extracted is not None
                                          and expression_value(extracted) == float(task["answer"]))
                if len(row["examples"]) < 4:
                    row["examples"].append(text[:160])
    for row in rows.values():
        row["tool_call_fraction"] = row["tool_calls"] / row["samples"]
    report = {"benchmark": "agent_prompt_probe", "job": "benchmarks/agent_tool_job.py",
              "model": args.model, "quick": args.quick, "temperature": job.TEMPERATURE, "max_new_tokens": args.max_new_tokens,
              "questions": args.questions, "samples_per_question": args.samples_per_question,
              "shipped": "examples_2", "prompts": rows, "seconds": time.perf_counter() - start,
              "machine": machine()}
    print(table(["prompt", "prompt tokens", "samples", "native tool calls", "print(a * b)", "direct correct",
                 "boxed the question"],
                [[name, str(r["prompt_tokens"]), str(r["samples"]), str(r["tool_calls"]), str(r["right_code"]),
                  str(r["direct_correct"]), str(r["boxed_question"])] for name, r in rows.items()]))
    print(f"wrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
