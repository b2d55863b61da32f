"""Routed-expert traces written by a serving engine, read for comparison with fcaudit's own
recording of the same tokens (``fcaudit routes``).

A trace is what vLLM's ``enable_return_routed_experts`` (``CompletionOutput.routed_experts``,
``[tokens, layers, top_k]`` per request) or SGLang's ``return_routed_experts`` give: the
expert ids each token took in each MoE layer, no weights, no logits. fcaudit reads one
integer array per file: ``[tokens, layers, k]`` (one request) or ``[requests, tokens,
layers, k]``, from ``.npy`` or ``.safetensors`` (its one tensor, or the one named
``routed_experts``). A request's rows hold its prompt tokens from ``prompt_start`` on and
then its completion's; the comparison takes the prompt's rows only, the tokens fcaudit
recorded. Negative ids are the engines' sentinels for rows they did not fill: such a
(token, layer) is counted as missing, never as a disagreement.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fcaudit.core.errors import DataError, arg

SUFFIXES = (".npy", ".safetensors")
TENSOR_NAME = "routed_experts"


def read_trace(path: Path) -> np.ndarray:
    """The trace in ``path`` as int64 ``[requests, tokens, layers, k]``."""
    if path.suffix not in SUFFIXES or not path.is_file():
        raise DataError(f"routing trace {path}: expected an existing {' or '.join(SUFFIXES)} "
                        "file of expert ids [tokens, layers, k] or [requests, tokens, layers, k]")
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
    else:
        from safetensors.numpy import load_file
        tensors = load_file(path)
        if len(tensors) != 1 and TENSOR_NAME not in tensors:
            raise DataError(f"routing trace {path} holds {sorted(tensors)}: name the trace "
                            f"{TENSOR_NAME!r}, or keep one tensor in the file")
        array = tensors.get(TENSOR_NAME, next(iter(tensors.values())))
    if not np.issubdtype(array.dtype, np.integer) or array.ndim not in (3, 4):
        raise DataError(f"routing trace {path}: {array.dtype} {list(array.shape)}; expected "
                        "integer expert ids [tokens, layers, k] or [requests, tokens, layers, "
                        "k]")
    return (array[None] if array.ndim == 3 else array).astype(np.int64)


def prompt_rows(trace: np.ndarray, windows: tuple[int, int], layers: Sequence[int | None],
                experts: int, prompt_start: int = 0) -> np.ndarray:
    """The rows of ``trace`` for ``windows`` (requests, tokens) prompts of that many tokens,
    ``[requests, tokens, routers, k]``: each request's rows from ``prompt_start`` on,
    checked against the model's routers (``layers``: each one's decoder layer, None where
    its path names none) and ``experts`` experts. vLLM's trace has a row for every decoder
    layer, the dense ones too (left zero): with more layers than routers, each router's
    own layer is taken."""
    requests, tokens = windows
    have, rows, have_layers, _ = trace.shape
    if have != requests:
        raise DataError(f"the routing trace holds {have} request(s) and the tokens {requests} "
                        "window(s): give one trace row block per window, in the same order")
    if rows < prompt_start + tokens:
        raise DataError(f"the routing trace has {rows} rows per request, fewer than the "
                        f"prompt's {tokens} tokens from row {prompt_start}: was it recorded "
                        f"on these tokens (and with this {arg('prompt_start')})?")
    picked = trace[:, prompt_start:prompt_start + tokens]
    if have_layers != len(layers):
        known = [i for i in layers if i is not None]
        if len(known) != len(layers) or len(set(known)) != len(known) or \
                have_layers < len(layers) or max(known) >= have_layers:
            raise DataError(f"the routing trace has {have_layers} layers and the model "
                            f"{len(layers)} routers (in decoder layers "
                            f"{', '.join(map(str, layers))}): a trace of another model, or of "
                            "another layer set")
        picked = picked[:, :, known]
    if (picked >= experts).any():
        raise DataError(f"the routing trace names expert {int(picked.max())}, and the model's "
                        f"routers have {experts} experts: a trace of another model")
    return picked
