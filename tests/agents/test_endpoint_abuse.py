"""The endpoint against abuse, on a real server on 127.0.0.1: other local users without a key (idle
connections, huge headers and bodies) and bad requests from the agent (malformed, deeply nested, too many,
concurrent). Every loop here is bounded and ends by itself."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from typing import Any

import httpx
import openai
import pytest

import flashrl.agents.session as session_module
from flashrl.agents import AgentLimits, ConnectionLimits

USER = [{"role": "user", "content": "What is 2 + 3?"}]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _closed_by_peer(reader: asyncio.StreamReader, within_s: float) -> bool:
    """Whether the server closed this connection (EOF or reset) within ``within_s``."""
    try:
        async with asyncio.timeout(within_s):
            while await reader.read(1 << 16):
                pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _host_port(server: Any) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def test_idle_connections_past_the_cap_are_closed_and_an_agent_still_gets_in(
    scripted_engine, serve, agent_client
) -> None:
    cap, flood = 8, 60

    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        before = _open_fds()
        sockets = [await asyncio.open_connection(*_host_port(server)) for _ in range(flood)]
        await asyncio.sleep(0.3)  # the server accepts them all
        server_side = _open_fds() - before - flood  # our own ends are `flood` descriptors
        live = len(server._server.server_state.connections)
        began = time.monotonic()
        closed = await asyncio.gather(*(_closed_by_peer(reader, 0.5) for reader, _ in sockets))
        reply = await agent_client(session).chat.completions.create(model=server.model_name, messages=USER)
        for _, writer in sockets:
            writer.close()
        return session, server_side, live, sum(closed), time.monotonic() - began, reply, server.connection_stats

    engine = scripted_engine(["Five.<|im_end|>"])
    session, server_side, live, closed, took, reply, stats = serve(
        engine, scenario, connections=ConnectionLimits(max_connections=cap, request_timeout_s=30.0)
    )
    # today: all 60 stay open (one descriptor each, until the process runs out)
    assert live <= cap and server_side <= cap + 4, (live, server_side)
    assert closed >= flood - cap and stats.evicted >= flood - cap
    assert took < 10.0
    assert reply.choices[0].message.content == "Five." and session.calls == 1


def test_a_connection_that_sends_no_request_is_closed_after_request_timeout_s(scripted_engine, serve) -> None:
    async def scenario(server):
        reader, writer = await asyncio.open_connection(*_host_port(server))
        writer.write(b"POST /sessions/x/v1/chat/completions HTTP/1.1\r\nHost: a\r\n")  # and never the rest
        began = time.monotonic()
        closed = await _closed_by_peer(reader, 5.0)
        writer.close()
        return closed, time.monotonic() - began, server.connection_stats.header_timeouts

    closed, took, timeouts = serve(scripted_engine([]), scenario,
                                   connections=ConnectionLimits(request_timeout_s=0.5))
    assert closed and took < 3.0 and timeouts == 1


def test_an_oversized_header_is_cut_off_early(scripted_engine, serve) -> None:
    header = 64 * 1024 * 1024

    async def scenario(server):
        reader, writer = await asyncio.open_connection(*_host_port(server))
        began = time.monotonic()
        sent = 0
        writer.write(b"POST /sessions/x/v1/chat/completions HTTP/1.1\r\nHost: a\r\nX-Big: ")
        chunk = b"a" * (1 << 20)
        try:
            while sent < header:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
        except (ConnectionResetError, BrokenPipeError):
            pass
        answer = b""
        try:
            answer = await asyncio.wait_for(reader.read(4096), 5.0)
        except (ConnectionResetError, TimeoutError):
            pass
        writer.close()
        return sent, time.monotonic() - began, answer, server.connection_stats.bad_http

    sent, took, answer, bad_http = serve(scripted_engine([]), scenario)
    # the server stops reading past 64 KiB of headers (the kernel's socket buffers take a few MiB more)
    assert sent < 24 * 1024 * 1024, sent
    assert took < 10.0 and bad_http == 1  # loose: the machine may be loaded; the bytes are the bound
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400")


def test_an_oversized_body_gets_413_before_it_is_parsed(scripted_engine, serve, monkeypatch) -> None:
    parsed: list[int] = []
    parse = session_module._parse_json
    monkeypatch.setattr(session_module, "_parse_json", lambda raw: parsed.append(len(raw)) or parse(raw))
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (4 << 20) + b'"}]}'

    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        headers = {"authorization": f"Bearer {session.api_key}", "content-type": "application/json"}
        url = f"{session.base_url}/chat/completions"

        async def chunked():  # no content-length: the limit holds while the body streams in
            for start in range(0, len(big), 1 << 16):
                yield big[start:start + (1 << 16)]

        async with httpx.AsyncClient(timeout=30) as http:
            declared = await http.post(url, content=big, headers=headers)
            streamed = await http.post(url, content=chunked(), headers=headers)
        return session, declared, streamed

    session, declared, streamed = serve(scripted_engine([]), scenario, max_request_bytes=1 << 20)
    for response in (declared, streamed):
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert parsed == [] and session.errors == Counter({"request_too_large": 2})


MALFORMED = {
    "nested_json": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nested_tool_schema": (
        b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
        b'{"name": "f", "parameters": ' + b'{"type": "array", "items": ' * 900 + b'{"type": "string"}'
        + b"}" * 900 + b"}}]}"
    ),
    "lone_surrogate": b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
}


def test_malformed_requests_are_counted_400s_that_leave_the_log_small(scripted_engine, serve, caplog) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        headers = {"authorization": f"Bearer {session.api_key}", "content-type": "application/json"}
        async with httpx.AsyncClient(timeout=60) as http:
            answers = {name: await http.post(f"{session.base_url}/chat/completions", content=body, headers=headers)
                       for name, body in MALFORMED.items()}
        return session, answers

    caplog.set_level(logging.DEBUG)
    session, answers = serve(scripted_engine([]), scenario)
    codes = {name: (r.status_code, r.json()["error"]["code"]) for name, r in answers.items()}
    assert codes == {"nested_json": (400, "invalid_json"), "nested_tool_schema": (400, "invalid_request"),
                     "lone_surrogate": (400, "invalid_request")}
    assert sum(session.errors.values()) == 3
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING and not r.name.startswith("vllm")]
    assert logged == [] and not any(r.exc_info for r in caplog.records)


def test_refused_requests_count_toward_max_refused(scripted_engine, serve) -> None:
    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits(max_refused=3))
        headers = {"authorization": f"Bearer {session.api_key}", "content-type": "application/json"}
        async with httpx.AsyncClient(timeout=30) as http:
            answers = [await http.post(f"{session.base_url}/chat/completions", content=b"not json", headers=headers)
                       for _ in range(5)]
        return session, [(r.status_code, r.json()["error"]["code"]) for r in answers]

    session, answers = serve(scripted_engine([]), scenario)
    assert answers == [(400, "invalid_json")] * 3 + [(429, "refusal_limit")] * 2
    assert session.errors == Counter({"invalid_json": 3, "refusal_limit": 2})


def test_requests_are_parsed_and_rendered_off_the_event_loop(scripted_engine, serve, agent_client,
                                                             monkeypatch) -> None:
    threads: list[str] = []
    check = session_module.check_request
    monkeypatch.setattr(session_module, "check_request",
                        lambda *a, **k: threads.append(threading.current_thread().name) or check(*a, **k))

    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0, limits=AgentLimits())
        render = session._recorder.prompt
        session._recorder.prompt = lambda *a, **k: threads.append(threading.current_thread().name) or render(*a, **k)
        await agent_client(session).chat.completions.create(model=server.model_name, messages=USER)
        return threading.current_thread().name

    loop_thread = serve(scripted_engine(["Five.<|im_end|>"]), scenario)
    assert len(threads) == 2 and all(name.startswith("agent-render") and name != loop_thread for name in threads)


def test_concurrent_calls_are_refused_for_tokens_only_once_the_sampled_tokens_use_them_up(
    scripted_engine, serve, agent_client
) -> None:
    two_tokens = [[330, 331]] * 200  # each call samples 2 tokens (of a budget of 6)

    async def scenario(server):
        session = server.open_session(prompt_id="p", seed=0,
                                      limits=AgentLimits(max_calls=200, max_completion_tokens=40, max_refused=200))
        client = agent_client(session)
        asyncio.get_running_loop().call_later(1.0, gate.set)  # the first calls sample while the others arrive
        results = await asyncio.gather(
            *(client.chat.completions.create(model=server.model_name, messages=USER) for _ in range(60)),
            return_exceptions=True,
        )
        return session, results

    gate = asyncio.Event()
    session, results = serve(scripted_engine(two_tokens, gate=gate), scenario)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    # today: 7 calls are served (the first reserve 6 tokens each), 14 tokens used, 53 refused
    assert session.calls == 20 and len(refused) == 40
    assert all(r.code == "completion_token_limit" for r in refused)
    assert session.errors == Counter({"completion_token_limit": 40})
    episode = session.to_episode(reward=0.0)
    assert episode is not None and sum(episode.loss_mask) == 40


@pytest.mark.parametrize("bad", [{"max_connections": 0}, {"max_header_bytes": 10}, {"request_timeout_s": 0}])
def test_connection_limits_are_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ConnectionLimits(**bad)


def test_a_command_agents_key_is_its_episodes_and_its_leftover_processes_are_gone(
    scripted_engine, serve, tmp_path
) -> None:
    """Today a leftover child of episode A outlives it and, holding the run-wide key, can call as episode B."""
    import sys
    import textwrap

    from flashrl.envs.agent_env import AgentEnv

    pid_file = tmp_path / "pid"
    script = textwrap.dedent(f"""
        import json, os, subprocess, sys, time, urllib.request
        leftover = "import os, time\\nif os.fork(): os._exit(0)\\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\\ntime.sleep(60)"
        subprocess.Popen([sys.executable, "-c", leftover], start_new_session=True).wait()
        while not os.path.exists({str(pid_file)!r}) or not open({str(pid_file)!r}).read():
            time.sleep(0.02)
        request = urllib.request.Request(
            os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            data=json.dumps({{"messages": [{{"role": "user", "content": "hi"}}]}}).encode(),
            headers={{"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"}},
        )
        reply = json.load(urllib.request.urlopen(request))
        print(json.dumps({{"reward": 1.0, "transcript": [reply["choices"][0]["message"]]}}))
    """)
    env = AgentEnv([{"id": "t"}], command=[sys.executable, "-c", script])
    env.reset(seed=0)

    async def scenario(server):
        a = server.open_session(prompt_id="a", seed=0, limits=AgentLimits())
        result = await env.run_agent(a.base_url, a.api_key, model_name=server.model_name, wall_time_s=60.0)
        a.close()  # the episode ends (as play_agent_episode closes it)
        b = server.open_session(prompt_id="b", seed=1, limits=AgentLimits())
        body = {"messages": USER}
        async with httpx.AsyncClient(timeout=30) as http:
            on_b = await http.post(f"{b.base_url}/chat/completions", json=body,
                                   headers={"authorization": f"Bearer {a.api_key}"})
            on_a = await http.post(f"{a.base_url}/chat/completions", json=body,
                                   headers={"authorization": f"Bearer {a.api_key}"})
        return a, b, result, on_b, on_a

    a, b, result, on_b, on_a = serve(scripted_engine(["Five.<|im_end|>", "Six.<|im_end|>"]), scenario)
    assert result.reward == 1.0 and a.calls == 1
    assert a.api_key != b.api_key
    assert (on_b.status_code, on_b.json()["error"]["code"]) == (401, "invalid_api_key") and b.calls == 0
    assert (on_a.status_code, on_a.json()["error"]["code"]) == (404, "session_closed")
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
