"""Early exit on any Hugging Face causal LM, LayerSkip style (``--early-exit``).

:class:`EarlyExitLM` wraps a loaded transformers model (``model.``) and makes it an exit
model (:class:`~fcaudit.core.contract.DeclaresExits`) without changing a weight:

* **exit heads** ``heads.{l}``: after decoder layer ``l`` (its layer stack, found by
  :func:`~fcaudit.core.discovery.transformers_layer_stack`), the model's own final norm,
  LM head and logit transform (found on a probe: :func:`own_head`) read the hidden
  state, ``[B, T, V]``;
* **controller sites** ``scores.{l}`` (every layer but the last): the confidence of that
  head, its softmax **maximum probability** per token, ``[B, T, 1]`` (CALM's softmax
  confidence; the maximum rather than the top-2 margin, so one threshold reads the same
  on every vocabulary size);
* **exit rules** ``halts.{l}``: a token stops after layer ``l`` where its confidence
  reaches ``threshold``;
* the wrapped model's **own sites** (a hybrid's routers, selection parameters and
  gates, found by :func:`~fcaudit.core.discovery.declared_sites`, and its routed
  layers), under ``model.``: an audit with ``--early-exit`` audits them beside the exit
  scores, as the audit without it would, so no site the model has is dropped.

A Hugging Face layer runs on the whole sequence (its attention mask, rotary positions and
cache are laid out per position), so it cannot skip a token. The wrapper therefore
**masks**: every layer still runs on every token, and an exited token's update is
discarded (its hidden state stays its exit layer's, CALM's state propagation, so later
layers' keys and values for it come from that state), and its logits are its exit head's.
The FLOPs an exit saves are **counted from the exits, not realised**: the execution
audit's hooks see every layer run on every token, and its latency is the full model's
plus the heads'. Each exit head costs a full LM head (``hidden x vocab`` multiply-adds per
token and layer), often more than the layer it would save.

A model not trained for early exit (LayerSkip's layer dropout and early-exit loss) has
poor intermediate heads: its early layers' predictions are rarely the final one's, so
the oracle exits late and the learned controller is only the softmax confidence. The
audit says so (:data:`HEADS_NOTE`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fcaudit.core.contract import Exit, ExpertLayer, Site
from fcaudit.core.discovery import declared_experts, declared_sites, transformers_layer_stack
from fcaudit.core.errors import ModelError, UsageError, arg
from fcaudit.core.exits import MASKED, Confidence, ExitHead, Halt
from fcaudit.core.hooks import hooks
from fcaudit.io.loading import LoadedModel

KIND = "hf-early-exit"  # LoadedModel.kind (audit.json model.kind) of a wrapped folder
FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")
HEADS_NOTE = ("this Hugging Face model was not trained for early exit (LayerSkip's layer "
              "dropout and early-exit loss): its intermediate layers read through the final "
              "norm and LM head are poor predictors, so early exits cost accuracy that a "
              "model trained for them would not lose")


def final_norms(model: nn.Module, layers: list[str]) -> list[nn.Module]:
    """Candidates for the model's final norm, the likeliest first: modules named as
    :data:`FINAL_NORMS` (``model.norm``, ``decoder.final_layer_norm``, ...), then any other
    norm outside the layer stack, the last registered first, and none (a model without a
    final norm). The probe of :func:`own_head` keeps the one the model is seen to use."""
    inside = tuple(f"{p}." for p in layers)
    named = [(path, m) for path, m in model.named_modules()
             if not path.startswith(inside) and path not in layers
             and (isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("Norm"))]
    preferred = [m for path, m in named if path.rsplit(".", 1)[-1] in FINAL_NORMS]
    return [*preferred, *(m for _, m in reversed(named) if m not in preferred), nn.Identity()]


def head_inputs(model: nn.Module, layers: list[str]) -> list[nn.Module]:
    """Candidates for the way from the last layer's output to the LM head's input: each
    final norm of :func:`final_norms`, then each followed by an output projection, a
    linear map outside the layer stack into the head's width (OPT-350m's ``project_out``:
    its embeddings are narrower than its layers). The probe of :func:`own_head` keeps the
    one the model is seen to use."""
    head = model.get_output_embeddings()
    inside = tuple(f"{p}." for p in layers)
    width = getattr(head, "in_features", None)
    projections = [m for path, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m is not head and m.out_features == width
                   and m.in_features != width and not path.startswith(inside)]
    norms = final_norms(model, layers)
    return [*norms, *(nn.Sequential(n, p) for p in projections for n in norms)]


Transform = Callable[[torch.Tensor], torch.Tensor]
PROBE_TOKENS = 16  # the probe window that finds a model's logit transform (at wrap time)


def logit_transforms(model: nn.Module) -> list[tuple[str, Transform]]:
    """What a transformers causal LM may do to its LM head's output before returning it,
    named. Its forward code decides, not a config key alone (Granite divides by
    ``logits_scaling``, HyperCLOVA X multiplies by it), so :func:`own_head` keeps the one
    the model is seen to do."""
    text = model.config.get_text_config()
    out: list[tuple[str, Transform]] = [("none", lambda x: x)]
    if cap := getattr(text, "final_logit_softcapping", None):
        out.append((f"softcap {cap}", lambda x: torch.tanh(x / cap) * cap))
        if mult := getattr(text, "output_multiplier", None):
            out.append((f"x {mult}, softcap {cap}", lambda x: torch.tanh(x * mult / cap) * cap))
    if scale := getattr(text, "logits_scaling", None):
        out += [(f"/ {scale}", lambda x: x / scale), (f"x {scale}", lambda x: x * scale)]
    if (ls := getattr(model, "logit_scale", None)) is not None and not callable(ls):
        out.append((f"x {ls}", lambda x: x * ls))
    if isinstance(softcap := getattr(model, "logit_softcap", None), nn.Module):
        out.append(("its logit_softcap", lambda x: softcap(x.float())))
    return out


def own_head(model: nn.Module, layers: list[str]) -> tuple[nn.Module, Transform]:
    """The model's own way from its last layer's output to its logits: a final norm and
    any output projection (of :func:`head_inputs`), its LM head and a transform (of
    :func:`logit_transforms`), found on a probe window. The last layer's output is caught
    by a hook and read through each candidate; the first equal to the logits the model
    returns is kept. A model none reproduces is refused: its exit heads would not read
    what it predicts, and every confidence would be silently off."""
    seen: list[torch.Tensor] = []
    probe = torch.arange(min(PROBE_TOKENS, model.config.get_text_config().vocab_size))
    catch = {layers[-1]: lambda _m, _a, out: seen.append(
        out[0] if isinstance(out, tuple) else out)}
    with hooks(model, catch), torch.no_grad():
        logits = model(input_ids=probe[None].to(model.device), use_cache=False).logits
    tolerance = 1e-5 * (1.0 + float(logits.float().abs().max()))
    norms, transforms = head_inputs(model, layers), logit_transforms(model)
    for norm in norms:
        try:
            with torch.no_grad():
                raw = model.get_output_embeddings()(norm(seen[-1]))
        except (RuntimeError, TypeError, ValueError):  # a norm of another width or call
            continue
        for _name, transform in transforms:
            with torch.no_grad():
                mine = transform(raw)
            if mine.shape == logits.shape and \
                    float((mine.float() - logits.float()).abs().max()) <= tolerance:
                return norm, transform
    raise ModelError(f"{arg('early_exit')}: {type(model).__name__}'s logits are not its last "
                     f"layer's output through a final norm and output projection ("
                     f"{len(norms) - 1} ways found outside its layers, or none), its LM head "
                     "and any transform fcaudit knows "
                     f"({', '.join(n for n, _ in transforms)}), checked on a {PROBE_TOKENS}-"
                     "token probe: its exit heads would not read what it predicts, so it "
                     "cannot be read the LayerSkip way; declare its exit sites yourself "
                     "(Site(role=Exit(...)), docs/method.md)")


class EarlyExitLM(nn.Module):
    """``input_ids [B, T] -> logits [B, T, V]``: a transformers causal LM whose tokens stop
    at the first layer whose head is confident enough (masked, see the module doc)."""

    execution_mode = MASKED

    def __init__(self, model: nn.Module, threshold: float) -> None:
        super().__init__()
        layers = transformers_layer_stack(model)
        if len(layers) < 2:
            raise ModelError(f"{arg('early_exit')}: no decoder layer stack of at least 2 "
                             f"layers found in {type(model).__name__}; early exit needs a "
                             "transformers causal LM")
        if model.get_output_embeddings() is None:
            raise ModelError(f"{arg('early_exit')}: {type(model).__name__} has no LM head "
                             "(get_output_embeddings); early exit reads every layer through it")
        self.model, self.layer_paths = model, [f"model.{p}" for p in layers]
        self.norm, self.transform = own_head(model, layers)
        self.full_depth = False
        n = len(layers)
        self.heads = nn.ModuleList(ExitHead() for _ in range(n))
        self.scores = nn.ModuleList(Confidence() for _ in range(n - 1))
        self.halts = nn.ModuleList(Halt(threshold) for _ in range(n - 1))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.transform(self.model.get_output_embeddings()(self.norm(h)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        state: dict[str, Any] = {"running": None}
        after = {p: lambda _m, args, out, i=i: self._after(i, args[0], out, state)
                 for i, p in enumerate(self.layer_paths)}
        with hooks(self, after):  # on the decoder layers for this one pass
            out = self.model(input_ids=input_ids, use_cache=False)
        return out.logits

    def _after(self, i: int, h_in: torch.Tensor, out: Any, state: dict[str, Any]) -> Any:
        """After layer ``i``: an exited token keeps its state; every token's head and
        confidence (an exited one's read its kept state), and the running ones' exits.
        Returns the layer's output with the masked state."""
        h = out[0] if isinstance(out, tuple) else out
        running = state["running"]
        if running is None:
            running = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        else:
            h = torch.where(running.unsqueeze(-1), h, h_in)
        if self.full_depth or i < len(self.halts):
            logits = self.heads[i](h, self._logits)
        if i < len(self.halts):
            stop = self.halts[i](self.scores[i](logits)[..., 0])
            state["running"] = running if self.full_depth else running & ~stop
        return (h, *out[1:]) if isinstance(out, tuple) else h

    def controller_sites(self) -> list[Site]:
        """The exit scores first, then the wrapped model's own sites (a hybrid's routers
        and selection sites), each under ``model.``."""
        exits = [Site(name=f"scores.{i}", path=f"scores.{i}", family="exit", layer=i,
                      axes=("example", "token"), positions=(1,), role=Exit())
                 for i in range(len(self.scores))]
        return exits + [dataclasses.replace(s, name=f"model.{s.name}", path=f"model.{s.path}")
                        for s in declared_sites(self.model) or ()]

    def expert_layers(self) -> list[ExpertLayer]:
        """The wrapped model's routed layers (none for a dense model), under ``model.``."""
        return [dataclasses.replace(x, name=f"model.{x.name}",
                                    experts=tuple(f"model.{p}" for p in x.experts))
                for x in declared_experts(self.model) or ()]

    def execution_blocks(self) -> list[str]:
        return list(self.layer_paths)

    def exit_heads(self) -> list[str]:
        return [f"heads.{i}" for i in range(len(self.heads))]

    def exit_rules(self) -> list[str]:
        return [f"halts.{i}" for i in range(len(self.halts))]

    def dense_counterpart(self) -> nn.Module:
        """The wrapped model itself: the same network, every layer on every token (its
        weights, not fresh ones; no memory is spent on a copy)."""
        return self.model


def with_early_exit(loaded: LoadedModel, threshold: float) -> LoadedModel:
    """``loaded`` with its model wrapped in :class:`EarlyExitLM` (kind :data:`KIND`). The
    fingerprint stays the model's own: the wrapping and its threshold, which moves every
    exit and so every cached output, are an option of the cache's identity of their own
    (engine/run.py's ``cache_identity``), so a rerun with another threshold is refused
    naming the threshold, not "another model"."""
    model = loaded.model
    if not type(model).__module__.startswith("transformers."):
        raise UsageError(f"{arg('early_exit')} wraps a Hugging Face causal LM (a transformers "
                         f"model, e.g. a folder given by path); {loaded.spec} is a "
                         f"{type(model).__name__}: give its own exit sites instead "
                         "(Site(role=Exit(...)), docs/method.md)", option="early_exit")
    wrapped = EarlyExitLM(model, threshold).eval()
    return dataclasses.replace(loaded, model=wrapped, kind=KIND)
