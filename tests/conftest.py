"""Shared test helpers and fixtures (test files import helpers from here, never from each
other): CLI runners and the checks of a clean failure (one line, exit 2, nothing
half-written), fast audit options, toy data and token files, hand-made run and checkpoint
folders, Markdown table parsing, and tiny random Hugging Face MoE families."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fcaudit import cli
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import AuditData, Document, train_tokenizer
from fcaudit.io.loading import save_run_model
from fcaudit.models.featuregate import GPT, GPTConfig

TESTS = Path(__file__).parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # makes the `toys:FACTORY` model specs importable


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny FeatureGate and Dense twins trained briefly on the built-in corpus (shared)."""
    from fcaudit.study.train import train
    root = tmp_path_factory.mktemp("runs")
    return {arch: train(arch, "tiny", 0, root / arch, steps=40, progress=False)
            for arch in ("featuregate", "dense")}


def optional_extra(module: str):
    """Import a package of an optional extra: skipped where it is not installed, except
    in CI, which installs every extra (there a missing package fails, never skips)."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


class _Lazy:
    """``transformers`` on first use (the [hf] extra): skipped where it is missing, except in
    CI, where a missing extra fails (:func:`optional_extra`)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(optional_extra("transformers"), name)


transformers = _Lazy()


TOY = ["--model", "toys:content_model", "--sites", "gates.*"]


FAST_ARGS = ["--quiet", "--no-execution", "--repeats", "1", "--bootstrap", "10", "--no-per-layer",
        "--batch-size", "4"]


@dataclasses.dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_inprocess(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Result:
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def strip_nondeterministic(audit: dict) -> dict:
    audit = json.loads(json.dumps(audit))
    for dotted in audit["nondeterministic_keys"]:
        *parents, leaf = dotted.split(".")
        node = audit
        for key in parents:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return audit


# ---- running the command line and checking what a failure leaves behind


def run_subprocess(argv: list[str], cwd: Path, prefix: list[str] | None = None) -> Result:
    """``python -m fcaudit.cli ARGV`` (or ``python PREFIX ARGV``) in a real process: what a
    SIGKILL, ``--debug`` and the console script's own stderr need."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, *(prefix or ["-m", "fcaudit.cli"]),
                           *map(str, argv)], capture_output=True, text=True, cwd=cwd, env=env)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def temporaries(root: Path) -> list[Path]:
    """Files left under a temporary name (a write that never reached its rename)."""
    return sorted(p for p in root.rglob("*") if p.name.endswith(".tmp"))


def assert_clean_failure(res: Result, root: Path, out: Path, needle: str | tuple[str, ...],
                         code: int = 2) -> None:
    """A refused run: one ``fcaudit:`` line holding ``needle``, exit ``code``, no traceback,
    no audit.json in ``out`` and no temporary file under ``root``."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code, res.stderr
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("fcaudit: "), lines[0]
    for part in (needle,) if isinstance(needle, str) else needle:
        assert part in lines[0], lines[0]
    assert "Traceback" not in res.stderr
    assert not (out / "audit.json").exists()
    assert not temporaries(root), temporaries(root)


def canonical(path: Path) -> str:
    """audit.json re-serialised like fileio.write_json after removing the
    nondeterministic keys: byte-comparable."""
    audit = strip_nondeterministic(json.loads(path.read_text(encoding="utf-8")))
    return json.dumps(audit, indent=2, sort_keys=True, allow_nan=False) + "\n"


@pytest.fixture
def tokens(tmp_path: Path) -> dict[str, Path]:
    """Evaluation (16 x 16) and calibration (12 x 16) token files for the toy models."""
    import toys
    files = {"eval": toys.pair_sequences(16, 16, 1), "calib": toys.pair_sequences(12, 16, 2)}
    out = {}
    for name, arr in files.items():
        out[name] = tmp_path / f"{name}.npy"
        np.save(out[name], arr)
    return out


def audit_argv(out: Path, tokens: dict[str, Path], model: str = "toys:content_model",
               extra: tuple = ()) -> list:
    """``fcaudit audit`` of a toy model on the :func:`tokens` files."""
    return ["audit", "--model", model, "--sites", "gates.*", "--out", out, *FAST_ARGS, *extra,
            "--tokens", tokens["eval"], "--calib-tokens", tokens["calib"]]


WORDS = ["king", "queen", "crown", "sword", "night", "day", "love", "death", "honour", "fool",
         "ghost", "castle", "letter", "storm", "father", "daughter", "poison", "ring", "river",
         "court"]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hand-made fcaudit run folder: a random tiny FeatureGate (context 32) with its own
    small tokenizer, written in the layout of `fcaudit train` (no training)."""
    root = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(WORDS, size=4000))
    (root / "text.txt").write_text(text, encoding="utf-8")
    tok = train_tokenizer([Document("text", text)], 300)
    cfg = GPTConfig(vocab_size=tok.get_vocab_size(), block_size=32, n_layer=2, n_head=2,
                    n_embd=16)
    torch.manual_seed(0)
    run = root / "run"
    run.mkdir()
    save_run_model(run, GPT(cfg))
    (run / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    (run / "config.json").write_text(json.dumps({
        "fcaudit_run": 1, "arch": "featuregate", "preset": "tiny", "seed": 0,
        "model_config": dataclasses.asdict(cfg), "train": {"seq_len": 16}}), encoding="utf-8")
    return root


FAST = AuditOptions(repeats=2, bootstrap=200, batch_size=4, execution=False, progress=False)


def toy_data(n_eval: int = 12, n_calib: int = 12, seq_len: int = 16) -> AuditData:
    import toys
    return AuditData(toys.pair_sequences(n_eval, seq_len, 1),
                     toys.pair_sequences(n_calib, seq_len, 2), {"source": "tokens"})


FIXTURES = Path(__file__).parent / "fixtures"


def md_cells(line: str) -> list[str]:
    """The cells of one GFM table row (escaped pipes do not split a cell)."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every GFM table in ``text``, each as rows of header -> cell."""
    tables, lines = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            headers = md_cells(lines[0])
            tables.append([dict(zip(headers, md_cells(ln), strict=True)) for ln in lines[2:]])
            lines = []
    return tables


def write_folder(tmp_path: Path, state: dict[str, torch.Tensor], layout: str,
                 config: dict | None = None) -> Path:
    """A folder in one of the Hugging Face layouts, holding ``state``."""
    folder = tmp_path / layout
    folder.mkdir()
    config = config or json.loads((FIXTURES / "mudd_tiny" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    keys = sorted(state)
    if layout == "safetensors":
        save_file(state, folder / "model.safetensors")
    elif layout == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:  # sharded-safetensors, sharded-bin: two shards + index
        ext = "safetensors" if layout == "sharded-safetensors" else "bin"
        stem = "model" if ext == "safetensors" else "pytorch_model"
        halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
        weight_map = {}
        for n, part in enumerate(halves, 1):
            shard = f"{stem}-0000{n}-of-00002.{ext}"
            chunk = {k: state[k] for k in part}
            if ext == "safetensors":
                save_file(chunk, folder / shard)
            else:
                torch.save(chunk, folder / shard)
            weight_map.update(dict.fromkeys(part, shard))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / f"{stem}.{ext}.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "mudd_tiny" / "model.safetensors")


FIXTURE = FIXTURES / "mudd_tiny"


def make_mudd_folder(root: Path) -> Path:
    """The tiny official-layout fixture plus a byte-level tokenizer with its 256 ids."""
    folder = root / "MUDDPythia-tiny"
    shutil.copytree(FIXTURE, folder, ignore=shutil.ignore_patterns("expected.*"))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def chromium() -> str | None:
    found = shutil.which("chromium")
    return found or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


VOCAB = 120


SEQ_LEN = 12


COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


TEXT = ("the router picks two experts for every token and the audit replays the frozen model "
        "with cached logits from other inputs to see whether the choice matters ") * 4


# family -> (config, shared-expert gates per layer, experts executed per token)
FAMILIES: dict[str, tuple[Callable[[], Any], int, int]] = {
    "mixtral": (lambda: transformers.MixtralConfig(
        **COMMON, intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2), 0, 2),
    "qwen2_moe": (lambda: transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=64, num_key_value_heads=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2), 1, 2),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=8,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2), 0, 2),
    "olmoe": (lambda: transformers.OlmoeConfig(
        **COMMON, intermediate_size=32, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2), 0, 2),
    "deepseek_v3": (lambda: transformers.DeepseekV3Config(  # group-limited, biased sigmoid
        **COMMON, intermediate_size=64, num_key_value_heads=4, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8), 0, 2),
    "gpt_oss": (lambda: transformers.GptOssConfig(
        **COMMON, intermediate_size=32, num_key_value_heads=2, head_dim=8,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8), 0, 2),
    "gemma4_text": (lambda: transformers.Gemma4TextConfig(  # router returns probabilities
        **COMMON, intermediate_size=64, moe_intermediate_size=32, num_key_value_heads=2,
        head_dim=8, global_head_dim=8, num_experts=4, top_k_experts=2, enable_moe_block=True,
        per_layer_config={}, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, layer_types=["sliding_attention", "full_attention"]),
        0, 2),
    "llama4_text": (lambda: transformers.Llama4TextConfig(  # experts run densely
        **COMMON, intermediate_size=32, intermediate_size_mlp=64, num_key_value_heads=2,
        head_dim=8, num_local_experts=4, num_experts_per_tok=1), 0, 4),
}


def tokenizer_file(folder: Path) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(vocab_size=VOCAB,
                                                              special_tokens=["[UNK]"]))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def save(config: Any, folder: Path, **kwargs: Any) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # routers start near zero; give them spread like a trained router
        for name, param in model.named_parameters():
            if ".gate." in name or ".router." in name:
                param.normal_(0, 0.5)
    model.save_pretrained(folder, **kwargs)
    tokenizer_file(folder)
    return folder


def token_batches(tokenizer: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation [4, T] and calibration [4, T] windows of the tokenized text."""
    ids = torch.tensor(tokenizer.encode(TEXT * 2).ids)
    windows = ids[: len(ids) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
    assert len(windows) >= 8 and int(windows.max()) < VOCAB
    return windows[:4], windows[4:8]


def observed_outputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Reference: every module's first output, seen by hooks that only look."""
    seen: dict[str, Any] = {}

    def look(name: str, out: Any) -> None:
        seen.setdefault(name, out)

    handles = [m.register_forward_hook(lambda _m, _a, out, name=name: look(name, out))
               for name, m in model.named_modules() if name]
    with torch.no_grad():
        model.eval()(ids)
    for h in handles:
        h.remove()
    return seen


# a small audit of a Hugging Face folder (4 evaluation windows, 1 repeat)
AUDIT_FAST = ["--max-eval", "4", "--max-calib", "2", "--repeats", "1", "--bootstrap", "20",
              "--batch-size", "2", "--no-per-layer", "--no-execution"]


@pytest.fixture(scope="module")
def hf_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Mixtral folder (FAMILIES) with its tokenizer."""
    pytest.importorskip("transformers")
    return save(FAMILIES["mixtral"][0](), tmp_path_factory.mktemp("mixtral"))


def replay_inputs(model: torch.nn.Module, data: AuditData, tmp_path: Path) -> Any:
    """What the engine feeds from, after a real audit of ``model``'s ``gates.*`` sites:
    its cache, the sites, empty profiles and one random draw (seed 5)."""
    from fcaudit.api import audit
    from fcaudit.core.interventions import StaticProfiles, draw
    from fcaudit.core.sites import find_sites
    from fcaudit.engine.cache import CoefficientCache
    from fcaudit.engine.plan import ReplayInputs
    audit(model, tmp_path, sites=["gates.*"], data=data, options=FAST, report=False)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    cache = CoefficientCache(tmp_path / "cache", manifest["identity"], FAST.batch_size,
                             len(data.eval_ids))
    sites = find_sites(model, ["gates.*"])
    n, seq_len = data.eval_ids.shape
    return ReplayInputs(cache, sites, StaticProfiles(sites), [draw(5, n, seq_len)], 0)
