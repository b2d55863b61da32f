"""GGUF files (llama.cpp's format) through transformers' GGUF support (extra ``gguf``).

Real checkpoints often arrive as one ``.gguf`` file, quantised. ``--model FILE.gguf``
loads it in one step: its architecture is read from the file's metadata first, and one
transformers cannot read is refused in one line before anything is dequantised; then
transformers builds the model from the metadata (a GGUF file holds no config.json) and
dequantises every tensor to float32 (or the ``--dtype`` asked for). The audit is of those
dequantised weights, and a note says so, with the quantisation types the file held: a
quantised kernel (llama.cpp's) computes other numbers than its dequantised weights do.

Loading is offline and code-free as for folders (:mod:`fcaudit.io.hf`): the file is read
from its local path, never remote code, never hub kernels. The tokenizer is the one the
file carries (``tokenizer.ggml.*``), converted by transformers; the model's identity is
the file's SHA-256.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from fcaudit.core.errors import ModelError, UsageError, install_extra
from fcaudit.io.fileio import sha256_file

SUFFIX = ".gguf"
INSTALL = install_extra("gguf")
# keys of transformers' GGUF mapping that are sections of the metadata, not architectures
_NOT_ARCHITECTURES = {"general", "tokenizer"}


def _modules() -> tuple[Any, Any]:
    try:
        import gguf
        import transformers
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError as exc:
        raise UsageError(f"loading a GGUF file needs transformers and gguf: {INSTALL}",
                         option="model") from exc
    transformers.utils.logging.disable_progress_bar()
    return gguf, gguf_utils


def _field(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def describe(path: Path) -> tuple[str, Counter[str]]:
    """The file's architecture and its tensors' types (``Q4_1``: 210, ``F32``: 61, ...);
    one line naming what is wrong for a file that is not a readable GGUF file."""
    gguf, _ = _modules()
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise ModelError(f"{path} is not a GGUF file gguf can read ({first})") from exc
    architecture = _field(reader, "general.architecture")
    if architecture is None:
        raise ModelError(f"{path}: its GGUF metadata names no general.architecture")
    return architecture, Counter(t.tensor_type.name for t in reader.tensors)


def check_architecture(path: Path, architecture: str) -> None:
    """Refuse, before anything is dequantised, an architecture transformers cannot read."""
    _, gguf_utils = _modules()
    known = sorted(set(gguf_utils.GGUF_SUPPORTED_ARCHITECTURES) - _NOT_ARCHITECTURES)
    if architecture not in known:
        import transformers
        raise ModelError(f"{path}: transformers {transformers.__version__} cannot read GGUF "
                         f"files of architecture {architecture!r} (it reads {', '.join(known)})"
                         "; convert the model to a Hugging Face folder with llama.cpp's or "
                         "the model's own tools, or audit another file")


def load_gguf(path: Path, dtype: torch.dtype | None = None
              ) -> tuple[nn.Module, Tokenizer | None, dict[str, str], str]:
    """The file's causal LM (eval mode, dequantised to ``dtype``, default float32), its
    tokenizer (None where transformers cannot convert it), ``{file name: SHA-256}`` and the
    note on what was loaded."""
    if not path.is_file():
        raise ModelError(f"model not found: {path} (a GGUF file is read from a local path)")
    architecture, types = describe(path)
    check_architecture(path, architecture)
    import transformers
    target = dtype or torch.float32
    common = {"gguf_file": path.name, "local_files_only": True, "trust_remote_code": False}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), dtype=target, use_kernels=False, **common)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ModelError(f"transformers could not build a causal LM from {path} "
                         f"({architecture}: {first})") from exc
    model.eval()
    model.config.use_cache = False  # whole windows, never incremental decoding
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), **common)
        backend = getattr(tokenizer, "backend_tokenizer", None)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        backend = None
    held = ", ".join(f"{name} {n}" for name, n in types.most_common())
    note = (f"loaded {path.name} ({architecture}) through transformers' GGUF support: every "
            f"tensor dequantised to {str(target).removeprefix('torch.')} (the file holds "
            f"{held}), so the audit is of the dequantised weights, not of a quantised kernel"
            + ("" if backend is not None else "; its tokenizer could not be converted: give "
               "token ids (--tokens, --calib-tokens)"))
    return model, backend, {path.name: sha256_file(path)}, note
