"""Why two unperturbed passes over the same batch differ: randomness, or state the model
carries from one call to the next.

A recurrent model that keeps its state between calls (a hidden state buffer, a generation
cache such as ``past_key_values`` or ``cache_params`` kept on the model) computes the
replay from what the record pass left behind: the replay cannot reproduce the record, and
no number would mean what it says. The identity probe already sees that two passes differ;
this module says which cause it is, so the one-line refusal can say what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from fcaudit.core.adapters import same_bits

STATE_FIX = ("reset that state at the start of every forward pass (or keep it outside the "
             "model) and disable any generation cache (use_cache=False, no past_key_values or "
             "cache_params kept between calls)")
STATE_CAUSE = "the model's output depends on earlier calls"


def _held_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The tensors a model holds besides its parameters: buffers, and tensors (or lists,
    tuples and dicts of them) kept as plain attributes of its modules."""
    yield from model.named_buffers()
    for prefix, module in model.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_"):  # _parameters, _buffers, _modules, hooks
                continue
            items = value.items() if isinstance(value, dict) else \
                enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
            for sub, item in items:
                if isinstance(item, Tensor):
                    name = f"{prefix}.{key}" if prefix else key
                    yield (name if sub is None else f"{name}[{sub!r}]"), item


def changed_by_a_call(model: nn.Module, call: Callable[[], Any]) -> list[str]:
    """The names of the tensors the model holds that one ``call`` added, removed or
    changed: state carried to the next call."""
    before = {name: t.detach().clone() for name, t in _held_tensors(model)}
    call()
    after = dict(_held_tensors(model))
    return [name for name in dict.fromkeys([*before, *after])
            if name not in before or name not in after
            or not same_bits(before[name], after[name].detach())]


def _seeded(call: Callable[[], Any], seed: int) -> Any:
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())
                               if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        return call()


def why_passes_differ(model: nn.Module, call: Callable[[], Any]) -> tuple[str, str | None]:
    """The cause of two passes over one batch giving different outputs, in words, and what
    to do when it is (or may be) state carried across calls, else None: a pass that changes
    the model's own tensors is state; two passes from the same random seed that still
    differ are state kept out of sight or nondeterministic kernels; otherwise randomness
    (dropout, sampling, a model in training mode)."""
    changed = changed_by_a_call(model, call)
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3
                                          else "")
        return (f"{STATE_CAUSE}: a forward pass changes tensors the model keeps ({shown}), "
                "state carried across calls such as a recurrent state or a generation cache, "
                "so a replay starts from what the record pass left behind"), STATE_FIX
    if not same_bits(_seeded(call, 0), _seeded(call, 0)):
        return (f"{STATE_CAUSE}: two passes over the same batch from the same random seed "
                "differ, so the model carries state across calls (a recurrent state or a "
                "generation cache, kept where fcaudit cannot see it) or runs nondeterministic "
                "kernels"), f"{STATE_FIX}, or use deterministic kernels,"
    return ("two unperturbed passes over the same batch already differ: the forward pass is "
            "not deterministic (dropout, sampling or training mode?)"), None
