"""Model families and the contract the audit engine relies on.

The engine never looks inside a model. A model tells it three things:

* ``controller_sites()``: the controllers whose outputs are the coefficients
  (module path, family, layer). Each such module's forward returns the
  coefficient tensor ``[batch, positions, *trailing]`` and the model uses that
  return value as is, so replacing the module by a stub replays coefficients.
* ``execution_blocks()``: module paths of the blocks whose executions we count.
* ``dense_counterpart()``: the same architecture without controllers (for the
  execution audit), built with fresh weights.

Models map ``input_ids [B, T]`` to logits ``[B, T, V]``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Site:
    """One controller inside a model.

    ``name`` is stable and shown in reports; ``path`` is the module path used to
    find the module (``model.get_submodule(path)``); ``family`` groups sites of the
    same kind across layers; ``layer`` is the site's index within its family.
    """

    name: str
    path: str
    family: str
    layer: int
