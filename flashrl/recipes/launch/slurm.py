"""`flashrl launch slurm PRESET`: an sbatch script that starts a Ray cluster on the job's nodes and submits
the tuned example to it.

The script asks SLURM for the node plan (``--nodes``, one task per node with every CPU, the GPUs and
the memory of one node), starts the Ray head on the first node with token authentication
(``RAY_AUTH_MODE=token``; the token is ``$RAY_AUTH_TOKEN`` if set, else a fresh one, exported to every
``srun`` step so only this job's processes can join), starts one Ray worker per other node with
``srun``, waits until every node has joined, then runs ``ray job submit --working-dir .`` of the tuned
example from the folder ``sbatch`` was called in (a flashrl checkout, installed on every node).
"""

from __future__ import annotations

import shlex

from flashrl.recipes.launch.job import LaunchJob

__all__ = ["render_sbatch"]

RAY_PORT = 6379
DASHBOARD_PORT = 8265
JOIN_TIMEOUT_S = 600


def render_sbatch(job: LaunchJob) -> str:
    """The sbatch script of ``job`` (see the module docstring)."""
    nodes = job.nodes
    resources = f"--num-cpus={nodes.cpus_per_node} --num-gpus={nodes.gpus_per_node}"
    command = shlex.join(["python", job.script, *job.script_args])
    gpus = f"#SBATCH --gpus-per-node={nodes.gpus_per_node}\n" if nodes.gpus_per_node else ""
    return f"""#!/bin/bash
# Rendered by `flashrl launch slurm {job.preset.name}`: {nodes.describe()}.
# Submit from a flashrl checkout installed on every node: sbatch {job.name}.sbatch
#SBATCH --job-name={job.name}
#SBATCH --nodes={nodes.num_nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={nodes.cpus_per_node}
{gpus}#SBATCH --mem={int(nodes.host_memory_gib)}G
set -euo pipefail

# Token authentication: the head, the workers and `ray job submit` share one token (srun passes the
# environment on); a node without it cannot join.
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN="${{RAY_AUTH_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(32))')}}"

nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head_node=${{nodes[0]}}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{{print $1}}')

srun --nodes=1 --ntasks=1 -w "$head_node" \\
    ray start --head --node-ip-address="$head_ip" --port={RAY_PORT} --dashboard-host=0.0.0.0 \\
    --dashboard-port={DASHBOARD_PORT} {resources} --block &
for node in "${{nodes[@]:1}}"; do
    srun --nodes=1 --ntasks=1 -w "$node" \\
        ray start --address="$head_ip:{RAY_PORT}" {resources} --block &
done

# Every node joined (or a clear error after {JOIN_TIMEOUT_S} s) before the job starts.
python - "$head_ip:{RAY_PORT}" {nodes.num_nodes} {JOIN_TIMEOUT_S} <<'PY'
import sys, time
import ray
address, wanted, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
while True:
    try:
        ray.init(address=address, log_to_driver=False)
        alive = sum(node["Alive"] for node in ray.nodes())
        ray.shutdown()
    except Exception:  # the head is still starting
        alive = 0
    if alive >= wanted:
        sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit(f"only {{alive}} of {{wanted}} Ray nodes joined {{address}} within {{timeout:.0f}} s; "
                 "see the srun steps' output (a worker without the head's RAY_AUTH_TOKEN cannot join)")
    time.sleep(5)
PY

ray job submit --address "http://$head_ip:{DASHBOARD_PORT}" --working-dir . -- {command}
"""
