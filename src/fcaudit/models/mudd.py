"""MUDDPythia / MUDDFormer (multiway dynamic dense connections), in one readable file.

A clean-room re-implementation of the official PyTorch inference code
(github.com/Caiyun-AI/MUDDFormer, ``pytorch/``), written so that the released
checkpoints load with their own state-dict keys and give the same numbers: the
fixtures in ``tests/fixtures/`` come from the official code and pin that down.

The architecture. Block ``i`` writes its raw output ``X_{i+1}``; the sources seen so
far are ``S = [X_0 (embeddings), X_1, ..., X_{i+1}]``. A small generator (the
*controller*) reads ``X_{i+1}`` and emits, for every position, the weights
``W_i [B, T, C_i, L_i]`` (``L_i = i + 2`` sources, ``C_i`` streams) after adding the
static bias ``dense_bs[i]``. Stream ``c`` is ``sum_j W_i[..., c, j] * S[j]``. Block
``i + 1`` takes its query, key and value inputs and its residual from the four
streams Q, K, V, R. The last layer has a single stream, which feeds the final norm
and the output head.

Controller sites, as the audit sees them. There is one site per layer, the module
``dynamic_dense.{i}``. Its forward takes the hidden state and the static bias and
returns the full weight after the bias, ``[B, T, C_i, L_i]``. The model mixes with
that return value as is, so a replay stub stands in for the generator *and* the bias.
A *folded* model (``dense`` without ``dynamic_dense``, written by ``fcaudit fold``) has
no generators: it mixes with ``dense_bs`` alone, DenseFormer's static dense connections.
The sites form two families:

* ``mudd``: layers ``0 .. N-2``, trailing ``[4, i + 2]`` (streams Q, K, V, R x sources).
  Component ``(c, j)`` is absolute source ``j`` (0 = embeddings, ``j`` = output of
  block ``j - 1``). So the components present in every layer of the family are
  ``j in {0, 1}`` for each of the 4 streams; the pooled figure covers all components.
* ``mudd.final``: the last layer, trailing ``[1, N + 1]``. It is a single
  output-mixing vector with a different role from the Q/K/V/R streams, so it gets its
  own global mean and variance decomposition instead of diluting those of ``mudd``.

Numerics that follow the official code on purpose (each changes bf16 results, and
some change fp32 results too):

* the rotary cos/sin table is rounded to float16 (MUDDPythia) or bfloat16
  (MUDDFormer), then used in float32 math;
* rotary is partial (``rotary_pct``) with NeoX "half" pairing; rotated pairs are
  written interleaved, as the reference does;
* MUDDPythia's softmax runs in the working dtype with a float16-min mask;
  MUDDFormer's upcasts to float32;
* the generator's RMS norm has no scale and no float32 upcast; the QK norm upcasts;
* the sources are mixed one by one in order ``j = 0, 1, ...`` in the working dtype.

Only the full-sequence forward exists (no KV cache): the audit never decodes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fcaudit.core.contract import Site
from fcaudit.core.errors import FcauditError, check_sizes

VARIANTS = ("muddpythia", "muddformer")
STREAMS = 4  # Q, K, V, R: the only dense_type ("qkvr") of the released checkpoints

# config.json keys without which the model is undefined; the official config classes
# would fill in silent defaults that differ from every released model
_REQUIRED = ("n_layer", "dim", "n_head", "intermediate_size", "vocab_size", "block_size",
             "rope_base", "norm_eps", "use_qk_norm", "dense", "dynamic_dense", "dense_type",
             "sepln", "expand_last", "round64")
_REQUIRED_PYTHIA = ("rotary_pct", "use_parallel_residual", "use_linear_bias")


@dataclass
class MuddConfig:
    """The official config.json fields (defaults: MUDDPythia-1.4B) plus ``variant``."""

    variant: str = "muddpythia"
    n_layer: int = 24
    dim: int = 2048
    n_head: int = 16
    n_local_heads: int = 16
    intermediate_size: int = 8192
    vocab_size: int = 50432
    block_size: int = 2048
    rope_base: float = 10000
    rotary_pct: float = 0.25
    norm_eps: float = 1e-5
    use_qk_norm: bool = True
    use_parallel_residual: bool = True
    use_linear_bias: bool = True
    dense: bool = True
    dynamic_dense: bool = True
    dense_type: str = "qkvr"
    sepln: bool = True
    expand_last: bool = True
    round64: bool = True

    def __post_init__(self) -> None:
        check_sizes(self, ("n_layer", "dim", "n_head", "n_local_heads", "intermediate_size",
                           "vocab_size", "block_size"))
        problems = []
        if self.variant not in VARIANTS:
            problems.append(f"variant {self.variant!r} is not one of {', '.join(VARIANTS)}")
        if self.n_layer < 2:
            problems.append("n_layer must be >= 2 (the FFN width schedule divides by n_layer-1)")
        if self.n_head < 1 or self.dim % self.n_head:
            problems.append(f"dim {self.dim} is not divisible by n_head {self.n_head}")
        elif self.rotary_dims % 2:
            problems.append(f"rotary dims int(head_dim*rotary_pct)={self.rotary_dims} is odd")
        if self.n_local_heads != self.n_head:
            problems.append("n_local_heads must equal n_head (the official code has no GQA)")
        if self.dense_type != "qkvr":
            problems.append(f"dense_type {self.dense_type!r} is not supported, only 'qkvr'")
        if self.dynamic_dense and not self.dense:
            problems.append("dynamic_dense needs dense: both true (MUDD), dense alone (static "
                            "mixing weights, a folded MUDD) or both false")
        if self.dense and not self.sepln:
            problems.append("sepln=false with dense connections is broken in the official code")
        if problems:
            raise FcauditError("invalid MUDD config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """Derived, as the official config class forces it (the JSON value is ignored)."""
        return self.dim // self.n_head

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    def ffn_dim(self, i: int) -> int:
        """FFN width of block i: grows linearly from 0.5x to 1.5x intermediate_size."""
        # Python round() (halves to even) on a float product, exactly as the reference
        return round(self.intermediate_size * (i / (self.n_layer - 1) + 0.5) / 128) * 128

    def streams(self, i: int) -> int:
        """C_i: Q, K, V, R streams, except one output stream after the last block."""
        return 1 if i == self.n_layer - 1 else STREAMS

    def generator_dim(self, i: int) -> int:
        """K_i, the generator's hidden size (round64 adds a block even at a multiple of 64)."""
        k = self.streams(i) * (i + 2)
        if self.expand_last and i == self.n_layer - 1:
            k *= 4
        return (k // 64 + 1) * 64 if self.round64 else k

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MuddConfig:
        """Build from an official config.json dict; missing architecture keys are an error."""
        variant = cfg.get("model_type")
        if variant not in VARIANTS:
            raise FcauditError(f"config.json model_type is {variant!r}, expected one of "
                               f"{', '.join(VARIANTS)}")
        required = _REQUIRED + (_REQUIRED_PYTHIA if variant == "muddpythia" else ())
        missing = [k for k in required if k not in cfg]
        if missing:
            raise FcauditError(f"{variant} config.json lacks required field(s): "
                               f"{', '.join(missing)}")
        if cfg["dense"] is not True or cfg["dynamic_dense"] is not True:
            raise FcauditError(f"{variant} config.json has dense/dynamic_dense off: a model "
                               "without dynamic dense connections has no controllers to audit")
        names = {f.name for f in dataclasses.fields(cls)} - {"variant"}
        values = {k: cfg[k] for k in names if k in cfg}
        values.setdefault("n_local_heads", cfg["n_head"])
        if variant == "muddformer":
            # the MUDDFormer code has full rotary, a sequential residual and no biases,
            # whatever these keys (absent from its config.json) might say
            values.update(rotary_pct=1.0, use_parallel_residual=False, use_linear_bias=False)
        try:
            return cls(variant=variant, **values)
        except TypeError as exc:  # e.g. a null where a number belongs
            raise FcauditError(f"{variant} config.json has a malformed field: {exc}") from exc


PRESETS: dict[str, MuddConfig] = {
    # trains on a 2-core CPU in minutes; the trainer replaces vocab_size
    "tiny": MuddConfig(n_layer=4, dim=128, n_head=4, n_local_heads=4, intermediate_size=512,
                       vocab_size=2048, block_size=256),
    # FeatureGate's mid and small shapes, the MUDD contrast of the trend study
    "mid": MuddConfig(n_layer=4, dim=256, n_head=4, n_local_heads=4, intermediate_size=1024,
                      vocab_size=2048, block_size=256),
    "small": MuddConfig(n_layer=6, dim=384, n_head=6, n_local_heads=6, intermediate_size=1536,
                        vocab_size=4096, block_size=256),
    "1.4b": MuddConfig(),  # MUDDPythia-1.4B, config_1p4b.json of the official repository
    "2.8b": MuddConfig(n_layer=32, dim=2560, n_head=32, n_local_heads=32,
                       intermediate_size=10240),  # MUDDPythia-2.8B, config_2p8b.json
}


class RMSNorm(nn.Module):
    """RMS norm with a learned scale, computed in float32 and cast back before scaling."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def make_norm(config: MuddConfig) -> nn.Module:
    if config.variant == "muddpythia":
        return nn.LayerNorm(config.dim, eps=config.norm_eps)
    return RMSNorm(config.dim, config.norm_eps)


def rope_table(config: MuddConfig, seq_len: int, device: torch.device) -> Tensor:
    """cos/sin for positions 0..seq_len-1, ``[T, R/2, 2]``, rounded like the reference table."""
    r = config.rotary_dims
    theta = 1.0 / (config.rope_base ** (torch.arange(0, r, 2, device=device).float() / r))
    angle = torch.outer(torch.arange(seq_len, device=device), theta)
    table = torch.view_as_real(torch.polar(torch.ones_like(angle), angle))
    return table.to(torch.float16 if config.variant == "muddpythia" else torch.bfloat16)


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate the first R dims of each head of ``x [B, T, H, hd]`` (NeoX half pairing)."""
    r = table.shape[1] * 2
    a, b = x[..., :r].float().unflatten(-1, (2, r // 2)).unbind(-2)  # dim m pairs with m + R/2
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    # written interleaved [a'0, b'0, a'1, ...] like the reference: the same permutation of
    # q and k dims, so scores are unchanged, and the float sums keep the reference order
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([rotated.type_as(x), x[..., r:]], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: MuddConfig) -> None:
        super().__init__()
        self.config = config
        d, bias = config.dim, config.variant == "muddpythia"  # MUDDFormer has no biases
        self.wq = nn.Linear(d, config.n_head * config.head_dim, bias=bias)
        self.wk = nn.Linear(d, config.n_local_heads * config.head_dim, bias=bias)
        self.wv = nn.Linear(d, config.n_local_heads * config.head_dim, bias=bias)
        self.wo = nn.Linear(d, d, bias=bias)
        if config.use_qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def forward(self, xq: Tensor, xk: Tensor, xv: Tensor, rope: Tensor) -> Tensor:
        cfg = self.config
        bsz, seq_len, _ = xq.shape
        q = self.wq(xq).view(bsz, seq_len, cfg.n_head, cfg.head_dim)
        k = self.wk(xk).view(bsz, seq_len, cfg.n_local_heads, cfg.head_dim)
        v = self.wv(xv).view(bsz, seq_len, cfg.n_local_heads, cfg.head_dim)
        if cfg.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        y = self.attend(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(bsz, seq_len, cfg.dim))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention with the reference's softmax precision and mask value.

        Not ``F.scaled_dot_product_attention``: it scales before the product and keeps
        the softmax in float32 blocks, which on the tiny fixture moves logits by 3e-6 in
        float32 and 8e-2 in bfloat16, where these explicit scores match the reference
        exactly. The T x T scores are small next to the weights at 2048 tokens.
        """
        scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]))
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                            device=q.device).tril()
        if self.config.variant == "muddpythia":  # working dtype, float16-min fill
            probs = scores.masked_fill(~causal, torch.finfo(torch.float16).min).softmax(-1)
        else:  # float32 softmax, float32-min fill, probabilities cast back
            probs = scores.float().masked_fill(~causal, torch.finfo(torch.float32).min)
            probs = probs.softmax(-1).to(q.dtype)
        return probs @ v


class GeluMLP(nn.Module):
    """MUDDPythia FFN: w2(gelu(w1 x)), exact erf GELU."""

    def __init__(self, config: MuddConfig, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, hidden, bias=config.use_linear_bias)
        self.w2 = nn.Linear(hidden, config.dim, bias=config.use_linear_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.gelu(self.w1(x)))


class SwiGLU(nn.Module):
    """MUDDFormer FFN: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: MuddConfig, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, hidden, bias=config.use_linear_bias)
        self.w3 = nn.Linear(config.dim, hidden, bias=config.use_linear_bias)
        self.w2 = nn.Linear(hidden, config.dim, bias=config.use_linear_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One transformer block; reads one stream (block 0, plain residual) or four (Q, K, V, R)."""

    def __init__(self, config: MuddConfig, i: int) -> None:
        super().__init__()
        self.parallel = config.use_parallel_residual
        self.attention = Attention(config)
        mlp = GeluMLP if config.variant == "muddpythia" else SwiGLU
        self.feed_forward = mlp(config, config.ffn_dim(i))
        self.ffn_norm = make_norm(config)
        if config.dense and i > 0:
            self.attention_norms = nn.ModuleList(make_norm(config) for _ in range(3))
        else:
            self.attention_norm = make_norm(config)

    def forward(self, x: Tensor | tuple[Tensor, ...], rope: Tensor) -> Tensor:
        if isinstance(x, Tensor):
            res = x
            q_in = k_in = v_in = self.attention_norm(x)
        else:
            res = x[3]
            q_in, k_in, v_in = (n(s) for n, s in zip(self.attention_norms, x[:3], strict=True))
        h = res + self.attention(q_in, k_in, v_in, rope)
        return h + self.feed_forward(self.ffn_norm(res if self.parallel else h))


class DynamicDense(nn.Module):
    """Controller of layer i: hidden state -> mixing weights ``[B, T, C_i, L_i]`` (after bias)."""

    def __init__(self, config: MuddConfig, i: int) -> None:
        super().__init__()
        self.streams, self.sources = config.streams(i), i + 2
        self.eps = config.norm_eps
        self.w1 = nn.Linear(config.dim, config.generator_dim(i), bias=False)
        self.w2 = nn.Linear(config.generator_dim(i), self.streams * self.sources, bias=False)

    def forward(self, x: Tensor, static: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # no scale/upcast
        dynamic = self.w2(F.gelu(self.w1(x))).unflatten(-1, (self.streams, self.sources))
        return dynamic + static  # flat index c * L + j, as the reference's (C L) split


def mix(weights: Tensor, sources: list[Tensor]) -> tuple[Tensor, ...]:
    """Stream c = sum_j weights[..., c, j] * sources[j], summed in source order."""
    # one source at a time, in the working dtype: an einsum would accumulate in float32
    # and round differently from the reference in bfloat16
    return tuple(sum(weights[:, :, c, j, None] * s for j, s in enumerate(sources))
                 for c in range(weights.shape[2]))


class MuddModel(nn.Module):
    """MUDDPythia / MUDDFormer decoder: ``input_ids [B, T]`` -> logits ``[B, T, V]``.

    With ``config.dense`` false it is the plain-residual twin (no generators, no
    ``dense_bs``), which :meth:`dense_counterpart` builds.
    """

    def __init__(self, config: MuddConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = make_norm(config)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.dense:
            self.dense_bs = nn.ParameterList(
                nn.Parameter(torch.empty(config.streams(i), i + 2)) for i in range(config.n_layer))
        if config.dynamic_dense:
            self.dynamic_dense = nn.ModuleList(
                DynamicDense(config, i) for i in range(config.n_layer))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Init for training from scratch; it starts as a plain residual transformer.

        As the official JAX training code: static weights select only the newest block
        output for every stream and the generators' output projections are zero, so the
        dense connections must be learned. Others: GPT-2 style.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
        for layer in self.layers:  # residual-branch outputs, scaled by depth
            for w in (layer.attention.wo.weight, layer.feed_forward.w2.weight):
                nn.init.normal_(w, std=0.02 / math.sqrt(2 * self.config.n_layer))
        for i, bs in enumerate(self.dense_bs if self.config.dense else ()):
            bs.zero_()
            bs[:, -1] = 1
            if self.config.dynamic_dense:
                nn.init.zeros_(self.dynamic_dense[i].w2.weight)

    def forward(self, input_ids: Tensor) -> Tensor:
        seq_len = input_ids.shape[1]
        if seq_len > self.config.block_size:
            raise FcauditError(f"sequence length {seq_len} exceeds the model's block_size "
                               f"{self.config.block_size}; use shorter windows")
        x = self.tok_embeddings(input_ids)
        rope = rope_table(self.config, seq_len, x.device)
        if not self.config.dense:
            for layer in self.layers:
                x = layer(x, rope)
            return self.output(self.norm(x))
        sources, streams = [x], x
        for i, layer in enumerate(self.layers):
            sources.append(layer(streams, rope))
            # the site's return value is the mixing weight itself: replaying a stub replays it
            weights = self.dynamic_dense[i](sources[-1], self.dense_bs[i]) \
                if self.config.dynamic_dense else self.dense_bs[i][None, None]  # folded
            streams = mix(weights.to(x), sources)  # no-op unless a replay brought another dtype
        return self.output(self.norm(streams[0]))

    def controller_sites(self) -> list[Site]:
        if not self.config.dynamic_dense:
            return []
        last = self.config.n_layer - 1
        return [Site(name=f"dynamic_dense.{i}", path=f"dynamic_dense.{i}",
                     family="mudd" if i < last else "mudd.final",
                     layer=i if i < last else 0, axes=("example", "token"), positions=(1,))
                for i in range(self.config.n_layer)]

    def execution_blocks(self) -> list[str]:
        return [f"layers.{i}" for i in range(self.config.n_layer)]

    def folded(self, key: str, values: list[Tensor]) -> MuddModel:
        """This model with each layer's mixing weights fixed at ``values[i][0]`` (``key``
        ``"layer"``: one ``[C_i, L_i]`` per layer and stream, the static-layer profile)
        held in ``dense_bs`` and no weight generator: DenseFormer's static dense
        connections, every other weight this model's."""
        if key != "layer":
            raise FcauditError(f"a MUDD model folds one set of mixing weights per layer "
                               f"(static-layer), not {key!r}")
        with torch.device("meta"):
            folded = MuddModel(dataclasses.replace(self.config, dynamic_dense=False))
        state = {k: v for k, v in self.state_dict().items()
                 if not k.startswith("dynamic_dense.")}
        for i, value in enumerate(values):
            if tuple(value.shape) != (1, *state[f"dense_bs.{i}"].shape):
                raise FcauditError(f"mixing weights of layer {i}: expected "
                                   f"{[1, *state[f'dense_bs.{i}'].shape]}, got {list(value.shape)}")
            state[f"dense_bs.{i}"] = value[0].to(state[f"dense_bs.{i}"].dtype)
        folded.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
        return folded.eval()

    def dense_counterpart(self) -> MuddModel:
        """The same transformer with plain residuals, fresh weights, this model's dtype/device."""
        ref = self.output.weight
        with torch.device("meta"):  # no throwaway float32 copy of a large model
            twin = MuddModel(dataclasses.replace(self.config, dense=False, dynamic_dense=False))
        twin = twin.to(dtype=ref.dtype).to_empty(device=ref.device)
        twin.init_weights()
        return twin.train(self.training)
