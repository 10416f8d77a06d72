"""A sandbox for model-written Python code: bubblewrap, else Landlock + seccomp, never silently none.

Quick use::

    from flashrl.envs.sandbox import Sandbox, SandboxConfig
    result = Sandbox(SandboxConfig(wall_time_s=5)).run("print(2 ** 10)")
    result.stdout  # "1024\\n"

Which backend gives which guarantee (each run is a fresh process; "auto" takes the first backend
whose probe passes: the probe must be refused a UDP socket, a fork, a write and a read outside its
work dir):

=========================  ==============================================  ==============================================
What                       ``bubblewrap``                                  ``landlock`` (bubblewrap missing)
=========================  ==============================================  ==============================================
Reads                      a root of its own: /usr, /lib*, /bin, /sbin,    Landlock allow-list: the same paths, /dev
                           /etc/ld.so.cache and /etc/localtime, the        null/zero/full/random/urandom and its own
                           interpreter's folders (venv and base install),  /proc entry; refused without Landlock.
                           the launcher; no /sys, home, project, /var,
                           /opt; Landlock on top where the kernel has it.
Writes                     a size-capped tmpfs /tmp (``workdir_bytes``)    a private size-capped tmpfs on the work dir
                                                                           (root or user namespaces), else the host
                                                                           dir, measured every 50 ms and killed past
                                                                           ``workdir_bytes``; Landlock: nowhere else
Processes                  own pid namespace (sees bwrap's init only)      /proc listing and other pids unreadable;
                                                                           shares the host's pid namespace, so
                                                                           seccomp takes pid 0 or its own only
                                                                           (priority, affinity, prlimit, sid, ...)
Tasks                      ``max_tasks`` (threads; RLIMIT_NPROC in a user  same (where no user namespace is
                           namespace of the run's own; as root under a     allowed: the uid's tasks at start plus
                           per-run uid), then EAGAIN inside                ``max_tasks``)
Network                    empty net namespace + seccomp: no ``socket``;   seccomp: no ``socket``; ``socketpair``
                           ``socketpair`` sockets cannot be addressed      sockets cannot be addressed (no connect,
                           (no connect, bind, sendmsg, addressed sendto)   bind, sendmsg, addressed sendto); Landlock
                                                                           TCP and abstract-socket scoping (ABI 4/6)
/proc/self/net (the        its own empty net namespace: none of the        a private net namespace where namespaces are
host's listening ports)    host's ports or unix sockets                    allowed (root or user namespaces): none;
                                                                           else the host's tables (Landlock's
                                                                           /proc/self rule covers them; documented)
Command lines it can read  its own: the interpreter's path and             its own: the interpreter's path and the
(/proc/self/cmdline)       /.flashrl-sandbox/_launcher.py; bwrap's         launcher's (flashrl's folder); no other
                           (pid 1, readable without Landlock) holds        process's; its cwd is the host work dir's
                           only ``--args FD -- <that>``; the launcher's    path
                           settings travel on stdin                        the launcher's settings travel on stdin
SysV IPC, POSIX mqueues    private IPC namespace + seccomp deny            private IPC namespace (where allowed) +
                                                                           seccomp deny
Fork, exec, signals        seccomp: no fork (threads only), signals and    same
                           SIGIO to itself only, no ptrace, mount, bpf,
                           keyctl, perf_event_open, userfaultfd,
                           io_uring, ...
Resources                  rlimits: address space, CPU s, file size, open  same
                           files, no core; wall time and output caps kill
                           the process group
cgroup v2                  where the machine delegates ``memory`` and      same
                           ``pids``: a cgroup per run with ``memory.max``
                           (address space + work dir), no swap, ``pids.max``
                           = ``max_tasks``
=========================  ==============================================  ==============================================

The seccomp policy is an allow-list (anything unlisted fails with ENOSYS; the escape routes listed in
``_seccomp_policy.py`` with EPERM). The rlimits are the
floor on every machine; cgroup limits come on top only where delegated (``_cgroup.py``).
``unconfined`` (only with ``allow_unconfined=True``) keeps the resource limits and nothing else.

A command agent of ``flashrl/Agent-v0`` runs here too, with ``env_config["sandbox"]``
(`flashrl.envs.sandbox.agent_command`): bubblewrap only, with ``fork`` and sockets allowed, tasks
capped, and a net namespace whose only way out is a relay to the agent's endpoint.
"""

from flashrl.envs.sandbox.config import SandboxConfig, SandboxResult
from flashrl.envs.sandbox.runner import (
    Sandbox,
    SandboxSetupError,
    SandboxUnavailableError,
    available_backends,
)

__all__ = [
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxSetupError",
    "SandboxUnavailableError",
    "available_backends",
]
