"""The policy as a Hugging Face folder (transformers and vLLM load it), written whole or not at all.

``export_hf`` streams a sharded policy to rank 0 bucket by bucket and writes safetensors files (tied
embeddings stored once); ``save_pretrained`` writes a whole model with transformers' own
``save_pretrained``. Both go through ``replace_folder``: the folder is written beside the target and
renamed into place, so a reader (an inference engine in another process) never sees half of one.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flashrl.checkpoints.save_failure import is_disk_error

__all__ = ["EXPORT_BUCKET_BYTES", "export_hf", "merge_adapter_folder", "replace_folder", "save_adapter",
           "save_pretrained"]

EXPORT_BUCKET_BYTES = 1 << 30
"""``export_hf``: the bytes rank 0 gathers before writing them (one safetensors file per bucket)."""


def export_hf(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    tensors: Iterable[tuple[str, torch.Tensor]],
    gather: Callable[..., torch.Tensor],
    tokenizer_source: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = EXPORT_BUCKET_BYTES,
) -> str:
    """Write the policy as a Hugging Face folder on rank 0, streamed: one bucket at a time; returns the path.

    The learner that shards the model hands over what to write and how to gather it: ``tensors``,
    every state-dict entry once under its Hugging Face name (sharded where sharded; a tied weight once,
    under its first name), and ``gather(tensor, dtype=..., device="cpu")``, one entry as a full CPU
    tensor cast to ``dtype`` (floating point only); ``flashrl.learners.fsdp`` gives both
    (``unique_state_items``, ``gather_full``). The full tensors are gathered one by one (a
    collective, every rank takes part and keeps only its shard) and packed into buckets of about
    ``bucket_bytes``; a decoder layer is never split over two buckets (transformers' weight
    conversions, e.g. fused MoE experts, work within a layer). Rank 0 writes each bucket as one safetensors file (``model-0000k-of-0000n``, with
    ``model.safetensors.index.json``; a single ``model.safetensors`` when one bucket holds everything),
    reverting transformers' load-time weight conversions per bucket as ``save_pretrained`` does, and
    drops it before the next: rank 0 holds one bucket beyond its shards, never the whole model. Tied
    weights are stored once (under the embedding's name). The config (the architecture without
    FSDP's class prefix, ``dtype``), the generation config and, from ``tokenizer_source``, the
    tokenizer complete the folder, which is written beside the target and renamed into place.
    ``dtype`` casts floating-point weights (e.g. ``torch.bfloat16`` for serving). Every rank calls this.
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"export_hf needs a transformers PreTrainedModel; got {type(model).__name__}.")
    target = Path(path).resolve()
    entries = dict(tensors)
    plan = _export_plan(model, entries, dtype=dtype, bucket_bytes=bucket_bytes)
    buckets = _GatheredBuckets(entries, gather, plan, dtype=dtype)
    refused = None
    if _rank() == 0:
        try:
            replace_folder(target, lambda tmp: _write_hf_folder(model, buckets, len(plan), tmp,
                                                                tokenizer_source=tokenizer_source, dtype=dtype))
        except Exception as error:
            if not is_disk_error(error):
                raise
            refused = error  # raised below, once rank 0 has joined the gathers the other ranks still make
    for _ in buckets:  # the other ranks join the same gathers (rank 0 consumed them while writing)
        pass
    if dist.is_initialized():
        dist.barrier()
    if refused is not None:  # every rank is past the export: the learners stay in step, a later save retries
        raise refused
    return str(target)


_LAYER_PREFIX = re.compile(r"^(.*?\.layers\.\d+)\.")


def _export_plan(model: nn.Module, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype | None,
                 bucket_bytes: int) -> list[list[str]]:
    """The export's buckets (state-dict names, in order): whole layers, about ``bucket_bytes`` each."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    groups: list[tuple[str, list[str], int]] = []  # (layer key or name, names, bytes)
    for name, tensor in tensors.items():
        if name in ignored:
            continue
        key = m.group(1) if (m := _LAYER_PREFIX.match(name)) else name
        out_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        size = tensor.numel() * out_dtype.itemsize  # numel of a DTensor: the full tensor's
        if groups and groups[-1][0] == key:
            groups[-1][1].append(name)
            groups[-1] = (key, groups[-1][1], groups[-1][2] + size)
        else:
            groups.append((key, [name], size))
    buckets: list[list[str]] = []
    filled = 0
    for _, names, size in groups:
        if not buckets or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].extend(names)
        filled += size
    return buckets


class _GatheredBuckets:
    """Iterates the buckets of a plan as ``{name: full CPU tensor}`` on rank 0 ({} elsewhere), gathering
    each tensor when its bucket is reached; a second iteration resumes where the first stopped."""

    def __init__(self, tensors: dict[str, torch.Tensor], gather: Callable[..., torch.Tensor],
                 plan: list[list[str]], *, dtype: torch.dtype | None) -> None:
        self._tensors = tensors
        self._gather = gather
        self._plan = iter(plan)
        self._dtype = dtype

    def __iter__(self) -> _GatheredBuckets:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        names = next(self._plan)
        bucket = {}
        for name in names:
            full = self._gather(self._tensors[name], dtype=self._dtype, device="cpu")
            if _rank() == 0:
                bucket[name] = full.contiguous()
            del full
        return bucket


def _write_hf_folder(
    model: nn.Module,
    buckets: Iterable[dict[str, torch.Tensor]],
    num_buckets: int,
    folder: Path,
    *,
    tokenizer_source: str | os.PathLike[str] | None,
    dtype: torch.dtype | None,
) -> None:
    """Rank 0: the safetensors files of ``buckets`` (one file each), the index, configs, tokenizer."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    weight_map: dict[str, str] = {}
    total = 0
    for k, bucket in enumerate(buckets):
        bucket = revert_weight_conversion(model, bucket)
        file = "model.safetensors" if num_buckets == 1 else f"model-{k + 1:05d}-of-{num_buckets:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in bucket.items()}, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in bucket.values())
        weight_map.update(dict.fromkeys(bucket, file))
        del bucket
    if num_buckets > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    master = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    config.dtype = str(dtype or master).removeprefix("torch.")
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(folder)
    if tokenizer_source is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(folder)


def replace_folder(path: str | os.PathLike[str], write: Callable[[Path], None]) -> str:
    """Write a model folder beside ``path`` with ``write(tmp)`` and rename it into place; returns it.

    Readers (inference engines in other processes) never see a half-written folder. A non-empty
    folder that is not a model folder (no ``config.json``) is never replaced.
    """
    target = Path(path).resolve()
    for folder in (target, *target.parents):
        if folder.exists() and not folder.is_dir():
            raise FileExistsError(
                f"{folder} is a file, expected a folder (or nothing) there to write the model folder {target}. "
                "Fix: pass a path whose folders are folders, or move the file away."
            )
    model_files = ("config.json", "adapter_config.json")  # a model, or a PEFT adapter (save_adapter)
    if target.exists() and any(target.iterdir()) and not any((target / f).is_file() for f in model_files):
        raise FileExistsError(
            f"{target} exists and is not a Hugging Face model folder (no config.json); not replacing it. "
            "Pass a new or empty folder."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; inference engines in other processes read it
    try:
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def save_pretrained(model: nn.Module, path: str | os.PathLike[str], *, tokenizer_source: str | os.PathLike[str]
                    ) -> str:
    """A whole (unsharded) model as a Hugging Face folder with the tokenizer of ``tokenizer_source``."""
    from transformers import AutoTokenizer

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(tmp)

    return replace_folder(path, write)


def save_adapter(peft_model: nn.Module, path: str | os.PathLike[str], *,
                 tokenizer_source: str | os.PathLike[str], merged: bool = False) -> str:
    """A LoRA policy's adapter in PEFT's format (``PeftModel.from_pretrained`` and vLLM's ``--lora-modules``
    load it), with the tokenizer; ``merged``: instead the base model with the adapter merged in, a
    plain Hugging Face folder (a copy is merged: the learner's model keeps its adapter)."""
    from transformers import AutoTokenizer

    def write(tmp: Path) -> None:
        if merged:
            copy.deepcopy(peft_model).merge_and_unload().save_pretrained(tmp, safe_serialization=True)
        else:
            peft_model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(tmp)

    return replace_folder(path, write)


def merge_adapter_folder(adapter: str | os.PathLike[str], base_model: str, path: str | os.PathLike[str]) -> str:
    """An exported adapter (``save_adapter``'s folder) merged into ``base_model`` (a local folder): a plain
    Hugging Face folder at ``path``, as ``save_adapter(merged=True)`` writes it from a live learner (the
    merge in float32; the tokenizer the adapter's folder holds, else the base's). ``flashrl eval`` serves it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        PeftModel.from_pretrained(base, os.fspath(adapter)).merge_and_unload().save_pretrained(
            tmp, safe_serialization=True)
        has_tokenizer = Path(adapter, "tokenizer_config.json").is_file()
        AutoTokenizer.from_pretrained(os.fspath(adapter) if has_tokenizer else base_model).save_pretrained(tmp)

    return replace_folder(path, write)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
