"""LoRA adapters through peft: the settings, the check of target modules, and the adapter's tensors.

The learner trains a LoRA adapter instead of the whole policy when ``LearnerSpec.lora_rank`` is set
(``docs/training.md``, LoRA). Everything here is shared by the learner (which wraps its policy with
``peft.get_peft_model``), the engines (the torch engine wraps its copy the same way; vLLM loads the
adapter from a PEFT folder) and the checkpoints (which save the adapter in PEFT's format):

- ``LoRASettings``: rank, alpha, target modules, dropout; ``peft_config()`` is the ``LoraConfig``.
- ``apply_lora``: inject the adapter into a transformers model in place (base weights frozen) and
  return the ``PeftModel``. The injected model keeps its class and its decoder/head attributes, so
  the learner's log-prob kernels run on it unchanged.
- ``adapter_names`` / ``is_adapter_name``: which state-dict entries are the adapter's (the only ones a
  LoRA run sends to the engines and checkpoints).
- ``lora_target_problem``: why ``target_modules`` match no linear layer of a model (or name MoE expert
  weights, which peft's LoRA layers do not wrap), for ``validate()``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALL_LINEAR",
    "VLLM_LORA_RANKS",
    "LoRASettings",
    "adapter_names",
    "apply_lora",
    "is_adapter_name",
    "linear_layer_names",
    "lora_target_problem",
    "peft_file_name",
    "write_adapter_folder",
]

ALL_LINEAR = "all-linear"
"""peft's target: every linear layer but the output head."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM 0.32 serves (its ``max_lora_rank`` choices: ``MaxLoRARanks`` in ``vllm/config/lora.py``)."""

ADAPTER_NAME = "default"
"""peft's name of the one adapter (it appears in every adapter tensor's state-dict name)."""


@dataclass(frozen=True)
class LoRASettings:
    """One LoRA adapter's shape (``LearnerSpec``'s ``lora_*`` settings, also an engine option as a dict)."""

    rank: int
    alpha: float
    target_modules: str = ALL_LINEAR
    """``all-linear``, or comma-separated module names (``q_proj,v_proj``)."""
    dropout: float = 0.0

    @property
    def targets(self) -> str | list[str]:
        """``target_modules`` as peft takes it."""
        if self.target_modules == ALL_LINEAR:
            return ALL_LINEAR
        return [t.strip() for t in self.target_modules.split(",") if t.strip()]

    def peft_config(self) -> Any:
        """The ``peft.LoraConfig`` of these settings (a causal LM, no bias)."""
        from peft import LoraConfig

        return LoraConfig(r=int(self.rank), lora_alpha=float(self.alpha), target_modules=self.targets,
                          lora_dropout=float(self.dropout), bias="none", task_type="CAUSAL_LM")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoRASettings:
        return cls(**dict(data))


def is_adapter_name(name: str) -> bool:
    """Whether a state-dict entry of a peft-injected model is an adapter tensor (``lora_A`` / ``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The adapter tensors' names in ``model``'s state dict (in its order)."""
    return [name for name in model.state_dict() if is_adapter_name(name)]


def peft_file_name(name: str) -> str:
    """A state-dict name as PEFT's ``adapter_model.safetensors`` spells it (what vLLM and peft load)."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def write_adapter_folder(folder: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor],
                         settings: LoRASettings, base_model: str) -> None:
    """Write an adapter's full tensors (state-dict names) into ``folder`` in PEFT's format, as
    ``PeftModel.save_pretrained`` does: ``adapter_config.json`` and ``adapter_model.safetensors``, what
    ``PeftModel.from_pretrained`` and vLLM's ``--lora-modules`` / ``LoRARequest`` load. Nothing but the
    adapter is read or written (no base weight), so a sharded learner or an engine writes it from tensors."""
    from safetensors.torch import save_file

    foreign = sorted(n for n in tensors if not is_adapter_name(n))
    if foreign:
        raise ValueError(f"an adapter folder holds lora_A / lora_B tensors only; got {foreign[:3]}.")
    config = settings.peft_config().to_dict()
    config["base_model_name_or_path"] = base_model
    # the layers the adapter has (what save_pretrained writes for 'all-linear' too): vLLM matches these names
    config["target_modules"] = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in tensors})
    Path(folder, "adapter_config.json").write_text(json.dumps(config, default=str, indent=2), encoding="utf-8")
    save_file({peft_file_name(n): t.detach().to("cpu").contiguous() for n, t in tensors.items()},
              str(Path(folder, "adapter_model.safetensors")), metadata={"format": "pt"})


def apply_lora(model: torch.nn.Module, settings: LoRASettings) -> Any:
    """Inject the adapter into ``model`` in place (base weights frozen); returns the ``PeftModel``.

    ``model`` itself keeps working as before (its linear layers now carry the adapter), so callers
    keep using it; the returned ``PeftModel`` is what saves the adapter in PEFT's format. Raises
    ``ValueError`` (expected, actual, fix) when the targets match no linear layer.
    """
    from peft import get_peft_model

    problem = _target_problem(model, settings.target_modules)
    if problem is not None:
        raise ValueError(problem)
    peft_model = get_peft_model(model, settings.peft_config(), adapter_name=ADAPTER_NAME)
    _match_adapter_dtypes(model)
    return peft_model


def _match_adapter_dtypes(model: torch.nn.Module) -> None:
    """Give every adapter layer the dtype peft gives it over a real base: the base weight's, float32 over a
    16-bit base (``autocast_adapter_dtype``). peft leaves an adapter built on the meta device (a sharded
    learner's model before it is filled) in the default dtype; everywhere else this changes nothing."""
    import torch

    for module in model.modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not hasattr(module, "get_base_layer"):
            continue
        base = getattr(module.get_base_layer(), "weight", None)
        if base is None or not base.dtype.is_floating_point:
            continue
        want = torch.float32 if base.dtype in (torch.float16, torch.bfloat16) else base.dtype
        for layers in (lora_a, lora_b):
            for layer in layers.values():
                if any(p.dtype != want for p in layer.parameters()):
                    layer.to(dtype=want)


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of ``model``'s linear layers (``q_proj``, ``down_proj``, ...; the head included)."""
    import torch

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name})


def _target_problem(model: torch.nn.Module, target_modules: str) -> str | None:
    import torch

    if target_modules == ALL_LINEAR:
        return None
    wanted = [t.strip() for t in target_modules.split(",") if t.strip()]
    modules = dict(model.named_modules())
    linear = linear_layer_names(model)
    fix = f"name some of the model's linear layers ({', '.join(linear)}), or use lora_target_modules='all-linear'"
    if not wanted:
        return f"lora_target_modules: expected 'all-linear' or module names; got {target_modules!r}. Fix: {fix}."
    for target in wanted:
        matched = [m for name, m in modules.items() if name.rsplit(".", 1)[-1] == target]
        if not matched:
            return (f"lora_target_modules: expected names of linear layers of the model; {target!r} matches no "
                    f"layer. Fix: {fix}.")
        if not any(isinstance(m, torch.nn.Linear) for m in matched):
            kind = type(matched[0]).__name__
            what = ("MoE expert weights (fused, not linear layers), which LoRA does not support here"
                    if "expert" in target.lower() or "expert" in kind.lower() else f"a {kind}, not a linear layer")
            return f"lora_target_modules: {target!r} names {what}. Fix: {fix}."
    return None


def lora_target_problem(model: str, target_modules: str) -> str | None:
    """Why ``target_modules`` cannot be trained in ``model``, or None (fine, or not known yet).

    A local model folder is built on the meta device from its ``config.json`` (no weights read); a
    model name that is not a local folder is checked when the learner loads it (``apply_lora``).
    """
    if target_modules == ALL_LINEAR:
        return None
    path = Path(os.fspath(model)) / "config.json"
    if not path.is_file():
        return None
    return _folder_target_problem(str(path.parent), target_modules)


@functools.lru_cache(maxsize=16)
def _folder_target_problem(folder: str, target_modules: str) -> str | None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        json.loads(Path(folder, "config.json").read_text(encoding="utf-8"))
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        return f"cannot read {folder}/config.json: {err}"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return _target_problem(model, target_modules)
