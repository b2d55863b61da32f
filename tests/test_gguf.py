"""GGUF files in one step: ``--model FILE.gguf`` loads llama.cpp's format through
transformers' GGUF support, dequantised, offline, and says so; an architecture transformers
cannot read is refused in one line before anything is dequantised.

The files are written here with the ``gguf`` package's own writer, from a tiny random
Llama whose weights are known: the loaded model must compute exactly what a Hugging Face
folder of the same (dequantised) weights computes. The Q/K rows are permuted as llama.cpp's
converter permutes them for its rotary layout, which transformers undoes on load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAST_ARGS, optional_extra, run_inprocess
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

transformers = optional_extra("transformers")
gguf = optional_extra("gguf")

from fcaudit.core.errors import ModelError  # noqa: E402
from fcaudit.io.loading import load  # noqa: E402

VOCAB, LAYERS, HEADS, KV_HEADS = 300, 2, 4, 2  # the 256 bytes, <s> and 43 merges
TEXT = "the gate scales the branch and the router picks experts for every token " * 8


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>"]))
    assert tok.get_vocab_size() == VOCAB
    return tok


def _llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary permutation of a Q or K projection's rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def write_gguf(path: Path, model: transformers.LlamaForCausalLM, tok: Tokenizer,
               quantized: str | None = None, architecture: str = "llama") -> dict[str, Tensor]:
    """The model as a GGUF file (2-D weights quantised to ``quantized``, e.g. ``Q8_0``);
    returns the weights transformers should load back (dequantised), by HF name."""
    c = model.config
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(VOCAB)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t == "<s>" else 1 for t, _ in vocab])
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    expected = {}
    for name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            data = _permute(data, HEADS)
        elif name.endswith("k_proj.weight"):
            data = _permute(data, KV_HEADS)
        if quantized and data.ndim == 2:
            kind = getattr(gguf.GGMLQuantizationType, quantized)
            packed = gguf.quantize(data, kind)
            w.add_tensor(_gguf_name(name), packed, raw_dtype=kind)
            data = gguf.dequantize(packed, kind).reshape(data.shape)
        else:
            w.add_tensor(_gguf_name(name), data)
        if name.endswith("q_proj.weight"):  # what transformers' reverse permutation gives
            data = _unpermute(data, HEADS)
        elif name.endswith("k_proj.weight"):
            data = _unpermute(data, KV_HEADS)
        expected[name] = torch.from_numpy(np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


Tensor = torch.Tensor


def _reference(model: transformers.LlamaForCausalLM, weights: dict[str, Tensor]
               ) -> transformers.LlamaForCausalLM:
    reference = _llama()
    reference.load_state_dict(weights)
    return reference


@pytest.mark.parametrize("quantized", [None, "Q8_0"])
def test_a_gguf_file_loads_as_the_model_its_weights_make(quantized: str | None,
                                                          tmp_path: Path) -> None:
    model, tok = _llama(), _tokenizer()
    weights = write_gguf(tmp_path / "tiny.gguf", model, tok, quantized)
    loaded = load(str(tmp_path / "tiny.gguf"))
    assert loaded.kind == "hf-gguf" and type(loaded.model).__name__ == "LlamaForCausalLM"
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        got = loaded.model(ids).logits
        want = _reference(model, weights)(ids).logits
    assert torch.equal(got, want)
    if quantized is None:  # float32 in the file: the very weights we wrote
        with torch.no_grad():
            assert torch.equal(got, model(ids).logits)
    held = "Q8_0 16, F32 5" if quantized else "F32 21"
    assert loaded.notes == (f"loaded tiny.gguf (llama) through transformers' GGUF support: "
                            f"every tensor dequantised to float32 (the file holds {held}), "
                            "so the audit is of the dequantised weights, not of a quantised "
                            "kernel",)
    assert loaded.tokenizer is not None  # the file's, as transformers converts it
    encoded = loaded.tokenizer.encode("the router picks experts")
    assert max(encoded.ids) < VOCAB and loaded.tokenizer.decode(encoded.ids) == \
        "the router picks experts"


def test_audit_and_sites_take_a_gguf_file(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    write_gguf(tmp_path / "tiny.gguf", _llama(), _tokenizer(), "Q8_0")
    rng = np.random.default_rng(0)
    for name in ("eval", "calib"):
        np.save(tmp_path / f"{name}.npy", rng.integers(1, VOCAB, (8, 12)))
    res = run_inprocess(["sites", "--model", tmp_path / "tiny.gguf"], capsys)
    assert res.returncode == 0, res.stderr
    assert "through transformers' GGUF support" in res.stderr
    assert "model.layers.*.mlp.act_fn" in res.stdout
    res = run_inprocess(["audit", "--model", tmp_path / "tiny.gguf", "--sites",
                         "model.layers.*.mlp.act_fn", "--tokens", tmp_path / "eval.npy",
                         "--calib-tokens", tmp_path / "calib.npy", "--out", tmp_path / "out",
                         *FAST_ARGS], capsys)
    assert res.returncode == 0, res.stderr
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert audit["identity_replay_max_abs_diff"] == 0.0
    assert audit["model"]["spec"] == str(tmp_path / "tiny.gguf")


def test_an_architecture_transformers_cannot_read_is_one_line(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    write_gguf(tmp_path / "odd.gguf", _llama(), _tokenizer(), architecture="rwkv7")
    with pytest.raises(ModelError, match=r"odd\.gguf: transformers \S+ cannot read GGUF files "
                                         r"of architecture 'rwkv7' \(it reads .*llama.*\)"):
        load(str(tmp_path / "odd.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    res = run_inprocess(["sites", "--model", tmp_path / "junk.gguf"], capsys)
    assert res.returncode == 2
    assert res.stderr.startswith("fcaudit: error: ") and res.stderr.count("\n") == 1
    assert "junk.gguf is not a GGUF file gguf can read" in res.stderr
