"""EarlyExit: a decoder-only LM whose tokens stop computing at a layer of their own (CALM).

The network is FeatureGate's Dense twin (same embeddings, blocks, final norm and LM head)
with an **exit head at every layer**: the shared final norm and LM head read the hidden
state after block ``l``. Training is LayerSkip's: the loss is the final layer's
next-token loss plus a weighted sum of the earlier heads' losses (weight ``(l + 1) / L``
times ``exit_loss_scale``, so late heads count more), every token running every layer.

The **controller** is CALM's learned confidence classifier: after block ``l`` (every
layer but the last) ``c_l = sigmoid(w_l . LN(h) + b_l)`` per token, ``[B, T, 1]``, trained
(on detached states, so it cannot bend the language model) towards CALM's consistency
target: 1 where head ``l``'s argmax equals the last head's. We chose the classifier over
the head's softmax margin because the margin needs the whole LM head (``C x V``
multiply-adds) at every layer for every running token, more than a block costs at this
size (``V = 2048 > 12 C = 1536``): it would spend the savings it is meant to find. The
classifier costs ``C`` per token and layer.

**Inference** (eval mode): a token whose ``c_l >= exit_threshold`` stops after block
``l`` (``blocks.{l}.halt`` is that rule, a module so that hooks see each layer's exits
``[B, T]``). Later blocks run on the running tokens only, gathered and scattered as
SkipGate does (``blocks.{l}.body`` is called with them packed, ``[N, C]``, so the
execution audit's hooks count exactly them). Running tokens still attend to the tokens
that left: CALM's way, an exited token's keys and values at a later layer are computed
from its last hidden state, propagated unchanged (docs/method.md, Early exit). Its
logits are its exit head's (the shared head on that state). The exit decision reads
the site's output and nothing else, so a replay that feeds scores moves the exits.

``full_depth`` (the :class:`~fcaudit.core.contract.DeclaresExits` switch): every token runs
every layer and every exit head ``heads.{l}`` runs on every token (the oracle exit reads
them); training runs this way too. The Dense twin is FeatureGate's (``gated=False``): the
same blocks always run to full depth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from fcaudit.core.contract import Exit, Site
from fcaudit.core.errors import FcauditError
from fcaudit.core.exits import ExitHead, Halt
from fcaudit.models.featuregate import GPT, Gate, GPTConfig, Update
from fcaudit.models.featuregate import PRESETS as GPT_PRESETS
from fcaudit.models.skipgate import Route


@dataclass(frozen=True)
class EarlyExitConfig(GPTConfig):
    # ``gated`` and ``gate_bias_init`` are inherited and ignored: the controller is the
    # exit classifier, whose bias starts at 0
    exit_threshold: float = 0.8  # a token exits where its confidence reaches this
    exit_loss_scale: float = 1.0  # weight of the earlier heads' losses (LayerSkip)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.exit_threshold <= 1.0:
            raise FcauditError(f"exit_threshold={self.exit_threshold} must be in (0, 1]: the "
                               "confidence is a sigmoid, and 1.0 must make a token exit")


PRESETS: dict[str, EarlyExitConfig] = {
    name: EarlyExitConfig(**dataclasses.asdict(cfg)) for name, cfg in GPT_PRESETS.items()}


def attention_mask(route: Route, seq_len: int) -> torch.Tensor:
    """``[B, 1, K, T]`` bool: the running token in slot ``k`` sees every position up to its
    own (padded slots see position 0 only, and are dropped again)."""
    qpos = torch.zeros(route.batch, route.width, dtype=torch.long, device=route.pos.device)
    qpos = qpos.index_put((route.seq, route.slot), route.pos)
    keys = torch.arange(seq_len, device=qpos.device)
    return (keys.view(1, 1, -1) <= qpos.unsqueeze(-1)).unsqueeze(1)


class RoutedKVUpdate(Update):
    """``F(h)`` of a block for the running tokens only; keys and values come from every
    token, an exited one's from its propagated last state (CALM)."""

    def forward(self, x: torch.Tensor, route: Route,  # type: ignore[override]
                h: torch.Tensor) -> torch.Tensor:
        """``x [N, C]``: the running tokens, packed; ``h [B, T, C]``: every token's state."""
        attn, (B, T, C), H = self.attn, h.shape, self.attn.n_head
        w, b = attn.qkv.weight, attn.qkv.bias
        q = F.linear(route.pad(self.ln_1(x)), w[:C], b[:C])  # [B, K, C]
        k, v = F.linear(self.ln_1(h), w[C:], b[C:]).split(C, dim=2)
        q, k, v = (t.reshape(B, -1, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(route, T))
        a = route.unpad(attn.proj(y.transpose(1, 2).reshape(B, -1, C)))
        return a + self.mlp(self.ln_2(x + a))


class ExitBlock(nn.Module):
    def __init__(self, cfg: EarlyExitConfig, decides: bool) -> None:
        super().__init__()
        self.body = RoutedKVUpdate(cfg)
        self.score = Gate(cfg) if decides else None  # confidence of the state after the block
        self.halt = Halt(cfg.exit_threshold) if decides else None

    def step(self, h: torch.Tensor, running: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer at inference: the running tokens advance, then those confident enough
        stop (``running [B, T]`` bool, updated)."""
        if running.any():
            route = Route.from_mask(running)
            h = route.scatter_add(h, self.body(route.gather(h), route, h))
        if self.score is None or self.halt is None:
            return h, running
        return h, running & ~self.halt(self.score(h)[..., 0])

    def full(self, h: torch.Tensor) -> torch.Tensor:
        """Every token through the block (training, full depth)."""
        return h + Update.forward(self.body, h)


def fixed_exit_depth(key: str, values: list[torch.Tensor], layers: int) -> int:
    """The depth a fixed-exit fold keeps: the exit layer ``values[0]`` plus one."""
    if key != "exit_depth" or len(values) != 1 or values[0].numel() != 1:
        raise FcauditError(f"an exit model folds one exit depth (key 'exit_depth', one value), "
                           f"not {key!r} with {len(values)} values")
    depth = int(values[0]) + 1
    if not 1 <= depth <= layers:
        raise FcauditError(f"exit depth {depth}: 1 to {layers}")
    return depth


class LayerExits:
    """The exit contract of a token-level exit model whose layer ``{LAYERS}.{l}`` holds
    ``body`` (the block counted), ``score`` (the site) and ``halt`` (its rule; both None
    at the last layer), each with an exit head ``heads.{l}`` (EarlyExit, Ponder)."""

    LAYERS, FAMILY = "blocks", "exit"

    def _logits(self, h: torch.Tensor) -> torch.Tensor:  # the shared final norm and LM head
        return self.lm_head(self.ln_f(h))

    def controller_sites(self) -> list[Site]:
        return [Site(name=f"{self.LAYERS}.{i}.score", path=f"{self.LAYERS}.{i}.score",
                     family=self.FAMILY, layer=i, axes=("example", "token"), positions=(1,),
                     role=Exit()) for i, b in enumerate(getattr(self, self.LAYERS))
                if b.score is not None]

    def execution_blocks(self) -> list[str]:
        return [f"{self.LAYERS}.{i}.body" for i in range(len(self.heads))]

    def exit_heads(self) -> list[str]:
        return [f"heads.{i}" for i in range(len(self.heads))]

    def exit_rules(self) -> list[str]:
        return [f"{self.LAYERS}.{i}.halt" for i, b in enumerate(getattr(self, self.LAYERS))
                if b.halt is not None]


class EarlyExitGPT(LayerExits, GPT):
    """``input_ids [B, T] -> logits [B, T, V]``; each token's logits from its exit layer."""

    def __init__(self, cfg: EarlyExitConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.full_depth = False
        self.aux_loss: torch.Tensor | float = 0.0
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        L = cfg.n_layer
        self.blocks = nn.ModuleList(ExitBlock(cfg, decides=i < L - 1) for i in range(L))
        self.heads = nn.ModuleList(ExitHead() for _ in range(L))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.init_weights(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        h = self.wte(input_ids) + self.wpe(torch.arange(T, device=input_ids.device))
        if self.training or self.full_depth:
            return self._full_depth(h, input_ids)
        running = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        for block in self.blocks:
            h, running = block.step(h, running)
        return self._logits(h)  # an exited token's state is its exit layer's

    def _full_depth(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Every layer and every exit head on every token; in training, the LayerSkip
        losses of the earlier heads and the classifiers' consistency losses go to
        ``aux_loss`` (the final head's loss is the trainer's)."""
        states, logits = [], []
        for block, head in zip(self.blocks, self.heads, strict=True):
            h = block.full(h)
            states.append(h)
            logits.append(head(h, self._logits))
        if self.training:
            self.aux_loss = self._exit_losses(states, logits, input_ids)
        return logits[-1]

    def _exit_losses(self, states: list[torch.Tensor], logits: list[torch.Tensor],
                     input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token losses of heads ``0..L-2`` on the positions whose next token is in the
        input (all but the last), weighted ``(l + 1) / L``; plus the classifiers' losses."""
        L, cfg = len(self.blocks), self.config
        target = input_ids[:, 1:].reshape(-1)
        final = logits[-1].detach().argmax(-1)
        total = torch.zeros((), device=input_ids.device)
        for i in range(L - 1):
            lm = F.cross_entropy(logits[i][:, :-1].reshape(-1, cfg.vocab_size), target)
            agree = (logits[i].detach().argmax(-1) == final).float()
            score = self.blocks[i].score(states[i].detach())[..., 0]
            total = total + cfg.exit_loss_scale * (i + 1) / L * lm \
                + F.binary_cross_entropy(score, agree) / (L - 1)
        return total

    def folded(self, key: str, values: list[torch.Tensor]) -> GPT:
        """Every token stopped after exit layer ``values[0]`` (``key`` ``"exit_depth"``, the
        fixed-exit condition): nothing runs past it, so this is the Dense twin truncated
        to that depth, its blocks and exit head (the shared final norm and LM head) this
        model's, with no exit classifier or rule."""
        depth = fixed_exit_depth(key, values, len(self.blocks))
        shared = {f.name: getattr(self.config, f.name) for f in fields(GPTConfig)}
        with torch.device("meta"):
            twin = GPT(GPTConfig(**{**shared, "gated": False, "n_layer": depth}))
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("blocks.")}
        for i in range(depth):
            state.update({f"blocks.{i}.body.{k}": v
                          for k, v in self.blocks[i].body.state_dict().items()})
        twin.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
        return twin.eval()

    def dense_counterpart(self) -> GPT:
        """FeatureGate's Dense twin of the same depth and width: every block on every token."""
        shared = {f.name: getattr(self.config, f.name) for f in fields(GPTConfig)}
        return GPT(GPTConfig(**{**shared, "gated": False}))
