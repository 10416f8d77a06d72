"""`flashrl launch slurm|kuberay PRESET`: the rendered sbatch script and RayJob manifest of one CPU and one
GPU preset, against golden files (tests/recipes/data/launch/; regenerate them with the commands in
GOLDEN when a change is meant), the manifest checked against the fields KubeRay's CRDs require, and a
plan the preset's actors do not fit, or actors pinned by Ray custom resources, refused with the reason."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from flashrl.cli import main

DATA = Path(__file__).parent / "data" / "launch"
IMAGE = "example.com/flashrl:0.1"
GOLDEN = {
    # file -> the flags after `flashrl launch <target> --image example.com/flashrl:0.1`
    "smollm2_arithmetic_cpu": ["smollm2_arithmetic_cpu", "--cpus-per-node", "8"],
    "qwen25_math_1p5b": ["qwen25_math_1p5b", "--num-nodes", "2", "--gpus-per-node", "4"],
}


def _render(capsys, target: str, flags: list[str]) -> str:
    assert main(["launch", target, "--image", IMAGE, *flags]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(GOLDEN))
@pytest.mark.parametrize(("target", "suffix"), [("slurm", "sbatch"), ("kuberay", "yaml")])
def test_the_rendered_job_is_the_golden_file(capsys, name, target, suffix):
    assert _render(capsys, target, GOLDEN[name]) == (DATA / f"{name}.{suffix}").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_sbatch_script_is_valid_bash_with_token_auth_and_the_plan(capsys, name):
    text = _render(capsys, "slurm", GOLDEN[name])
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # parses as bash
    gpu = name == "qwen25_math_1p5b"
    assert f"#SBATCH --nodes={2 if gpu else 1}\n" in text
    assert ("#SBATCH --gpus-per-node=4\n" in text) == gpu
    assert "export RAY_AUTH_MODE=token\n" in text and 'export RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:-' in text
    assert "ray start --head" in text and 'ray start --address="$head_ip:6379"' in text
    assert f"--num-gpus={4 if gpu else 0} --block &" in text
    assert f"--working-dir . -- python tuned_examples/{name}.py {' '.join(GOLDEN[name][1:])}\n" in text


# The fields KubeRay's CRDs require (no `omitempty`): RayClusterSpec.headGroupSpec; HeadGroupSpec.rayStartParams,
# .template; WorkerGroupSpec.groupName, .minReplicas, .maxReplicas, .rayStartParams, .template.
HEAD_REQUIRED = {"rayStartParams", "template"}
WORKER_REQUIRED = {"groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"}


@pytest.mark.parametrize(("name", "nodes", "cpus", "gpus", "memory"), [
    ("smollm2_arithmetic_cpu", 1, "8", None, "24Gi"),
    ("qwen25_math_1p5b", 2, "96", "4", "1024Gi"),
])
def test_the_rayjob_has_the_crd_fields_and_the_plan_s_pods(capsys, name, nodes, cpus, gpus, memory):
    manifest = yaml.safe_load(_render(capsys, "kuberay", GOLDEN[name]))
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    assert manifest["metadata"]["name"] == "flashrl-" + name.replace("_", "-")
    spec = manifest["spec"]
    assert spec["entrypoint"] == "flashrl train " + " ".join(GOLDEN[name])
    cluster = spec["rayClusterSpec"]
    head, [workers] = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert HEAD_REQUIRED <= set(head) and WORKER_REQUIRED <= set(workers)
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == nodes - 1
    for group in (head, workers):
        params = group["rayStartParams"]
        assert all(isinstance(value, str) for value in params.values())  # map[string]string
        assert (params["num-cpus"], params["num-gpus"]) == (cpus, gpus or "0")
        [container] = group["template"]["spec"]["containers"]
        assert container["image"] == IMAGE
        for kind in ("requests", "limits"):
            quantities = container["resources"][kind]
            assert (quantities["cpu"], quantities["memory"], quantities.get("nvidia.com/gpu")) == (cpus, memory, gpus)


def test_a_plan_with_too_few_gpus_per_node_is_refused_with_the_reason(capsys):
    # qwen25_math_1p5b puts each learner and each runner on a GPU of its own: none fits a GPU-less node.
    assert main(["launch", "slurm", "qwen25_math_1p5b", "--gpus-per-node", "0"]) == 2
    err = capsys.readouterr().err
    assert "learner 0 needs 1 GPUs on one node, but the node plan has 0 per node" in err
    assert "Fix: --gpus-per-node 1 or more" in err
    # 8 one-GPU actors on one node of 4 GPUs: each fits, all do not.
    assert main(["launch", "kuberay", "--image", IMAGE, "qwen25_math_1p5b", "--gpus-per-node", "4"]) == 2
    assert "the actors (8 GPUs, 32 CPUs in all) do not fit 1 node(s) x [4 GPUs" in capsys.readouterr().err


def test_kuberay_without_an_image_is_refused(capsys):
    assert main(["launch", "kuberay", "smollm2_arithmetic_cpu"]) == 2
    assert "expected --image, a container image with flashrl" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["slurm", "kuberay"])
def test_actors_pinned_by_custom_resources_are_refused_as_no_launched_node_offers_them(capsys, target):
    # The launchers start nodes with CPUs and GPUs only: a runner asking for rollout_node would wait unplaced.
    flags = ["smollm2_arithmetic_cpu", "--cpus-per-node", "8", "--custom-resources-per-env-runner", "rollout_node=1"]
    assert main(["launch", target, "--image", IMAGE, *flags]) == 2
    err = capsys.readouterr().err
    assert "custom_resources_per_env_runner={'rollout_node': 1.0}" in err
    assert "1 node(s) x [8 CPUs" in err and "Fix: drop them for a launched job" in err
    # Nothing asked (amount 0) places nothing: the job renders as without the flag.
    flags[-1] = "rollout_node=0"
    assert main(["launch", target, "--image", IMAGE, *flags]) == 0


def test_a_learner_side_ask_is_refused_only_when_a_learner_actor_exists(capsys):
    # The CPU preset trains in the driver (num_learners=0): no learner actor, so the ask places nothing.
    flags = ["smollm2_arithmetic_cpu", "--cpus-per-node", "8", "--custom-resources-per-learner", "trainer_node=1"]
    assert main(["launch", "slurm", *flags]) == 0
    capsys.readouterr()
    assert main(["launch", "slurm", *flags, "--num-learners", "1"]) == 2
    err = capsys.readouterr().err
    assert "custom_resources_per_learner={'trainer_node': 1.0}" in err and "custom_resources_per_env_runner" not in err
