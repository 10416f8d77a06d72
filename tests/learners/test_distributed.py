"""Process-group backends: a CUDA learner's group also serves CPU tensors (optimizer offload), and every
collective flashrl issues is checked against the backends of its group."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from flashrl.learners.distributed import backend_devices, check_collective_device, default_backend


def test_a_cuda_group_has_gloo_for_cpu_tensors_beside_nccl():
    # FSDP2's CPUOffloadPolicy keeps gradient shards on the host: the clip's norm is a CPU tensor.
    assert default_backend(torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
    assert default_backend(torch.device("cpu")) == "gloo"


@pytest.mark.parametrize(("config", "devices"), [
    ("cuda:nccl,cpu:gloo", {"cuda", "cpu"}),
    ("cuda:nccl", {"cuda"}),
    ("nccl", {"cuda"}),
    ("cpu:gloo,cuda:gloo", {"cpu", "cuda"}),
    ("gloo", {"cpu", "cuda"}),
])
def test_backend_devices(config, devices):
    assert backend_devices(config) == devices


def test_a_cpu_collective_on_an_nccl_only_group_is_refused_with_the_fix():
    with pytest.raises(RuntimeError, match=r"a collective on a cpu tensor, but the process group's backends are "
                                           r"'cuda:nccl'\. Fix: .*'cuda:nccl,cpu:gloo'"):
        check_collective_device(torch.zeros(1), "cuda:nccl")
    check_collective_device(torch.zeros(1), "cuda:nccl,cpu:gloo")  # no error


def test_the_check_reads_torchs_own_backend_config_of_a_real_group(tmp_path):
    """A one-rank group made with a device-keyed backend string: torch's config parses to its devices and
    the sum over ranks passes the check (in a subprocess: the test process keeps no process group)."""
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from flashrl.learners import distributed
        dist.init_process_group(backend="cpu:gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        print(sorted(distributed.backend_devices(str(dist.get_backend_config()))))
        distributed.check_collective_device(torch.ones(2))
        dist.all_reduce(t := torch.ones(2)); print(t.tolist())
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["['cpu']", "[1.0, 1.0]"]
