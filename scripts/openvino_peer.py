"""OpenVINO GenAI as a peer of the benchmarks: its own virtual environment and the export of our weights.

OpenVINO GenAI's `WhisperPipeline` is the strongest CPU runtime for Whisper we know of (issue 31). It is
set up here, not by the project's set-up: its export tool (optimum-intel) pins its own torch and
transformers, which must not move the server's. Both steps run once and are cached:
- a virtual environment under the cache directory with the pinned packages below, which also sees this
  checkout's environment (a .pth file) for the benchmark's own code (manifests, scoring, audio);
- `optimum-cli export openvino` of the server's own tiny.en checkpoint (the Hugging Face folder
  `engine.model.weights` converts the bundled CTranslate2 weights into), int8 weights as OpenVINO's CPU
  default for a user who asks for int8, run with OpenVINO's own CPU defaults (bf16 compute where the CPU
  has it).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
from pathlib import Path

PINS = ("optimum-intel[openvino]==2.2.0", "openvino-genai==2026.4.1.0", "openvino==2026.4.1")


def cache_dir() -> Path:
    from engine.model.weights import default_cache_dir

    return default_cache_dir()


def venv_python(cache: Path | None = None) -> Path:
    """The peer's interpreter, its environment made on first use (minutes: it installs its own torch)."""
    cache = cache or cache_dir()
    key = hashlib.sha256("\n".join(PINS).encode()).hexdigest()[:12]
    venv = cache / f"openvino-peer-venv-{key}"
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():
        make_venv(venv, python)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # After its own packages: this checkout's environment (the benchmark's code, its data libraries), as a
    # site directory so that its own .pth files (the editable install's) are read too.
    ours = sysconfig.get_paths()["purelib"]
    (Path(site) / "asr-checkout.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


def make_venv(venv: Path, python: Path) -> None:
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", str(venv)], check=True)
    print(f"[openvino] installing {' '.join(PINS)} into {venv} (once)", file=sys.stderr, flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
    (venv / "ready").touch()


def exported_model(weight_format: str = "int8", cache: Path | None = None) -> Path:
    """tiny.en as OpenVINO IR (encoder, decoder with past, tokenizer and detokenizer), exported once."""
    from engine.model.weights import load

    cache = cache or cache_dir()
    hf_folder = load("tiny.en").hf_folder
    out = cache / f"openvino-{hf_folder.name}-{weight_format}"
    if (out / "openvino_decoder_model.xml").exists():
        return out
    python = venv_python(cache)
    print(f"[openvino] exporting {hf_folder} ({weight_format}) to {out} (once)", file=sys.stderr, flush=True)
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run(
        [str(python.parent / "optimum-cli"), "export", "openvino", "--model", str(hf_folder),
         "--task", "automatic-speech-recognition-with-past", "--weight-format", weight_format, str(tmp)],
        check=True,
    )  # fmt: skip
    tmp.rename(out)
    return out
