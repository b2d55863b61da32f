"""Golden audit.json files: the same audits before and after a refactor must agree outside
``runtime`` (and the keys audit.json itself lists as nondeterministic).

    python tests/golden_audits.py write OUT_DIR      # run every case, write OUT_DIR/CASE.json
    python tests/golden_audits.py compare OLD NEW    # keys may be added, none removed or changed

Cases: every model family and analysis (the demo, the planted toys, MUDD, the tiny MoE,
FeatureGate with its twin and the savings frontier, SkipGate, Mamba with its S4D twin on
tokens and on selective copying, the early-exit LM, ponder, the vision families (ViT-MoE,
TokenPrune, CondConv, Branchy), a Hugging Face Mixtral with the savings frontier and expert
ablation, a Hugging Face Mamba, ``--early-exit`` on a Hugging Face Llama, a custom
intervention and ``--target-ci``); every model random-initialised from a fixed seed. The
canonical outputs live in tests/golden/ (``python tests/golden_audits.py write
tests/golden`` after a deliberate change of output); tests/test_golden.py requires every case
to reproduce them exactly.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import fcaudit  # noqa: E402
from fcaudit import AuditData, AuditOptions  # noqa: E402
from fcaudit.cli import main  # noqa: E402

FAST = dict(repeats=2, bootstrap=200, batch_size=4, progress=False, timing_pairs=0)


def _toy_data() -> AuditData:
    import toys
    return AuditData(toys.pair_sequences(12, 16, 1), toys.pair_sequences(12, 16, 2),
                     {"source": "tokens"})


def _cli(args: list[str], out: Path) -> Path:
    code = main([*args, "--quiet", "--out", str(out)])
    if code != 0:
        raise SystemExit(f"fcaudit {' '.join(args)} exited {code}")
    return out / "audit.json"


def demo(tmp: Path) -> Path:
    _cli(["demo"], tmp / "demo")
    return tmp / "demo" / "audit" / "audit.json"


def toys_case(mode: str) -> Callable[[Path], Path]:
    def run(tmp: Path) -> Path:
        import toys
        model = getattr(toys, f"{mode}_model")()
        sites = None if "router" in mode else ["gates.*"]
        fcaudit.audit(model, tmp / mode, sites=sites, data=_toy_data(),
                      options=AuditOptions(**FAST, execution=False), report=False)
        return tmp / mode / "audit.json"
    return run


def mudd(tmp: Path) -> Path:
    from conftest import make_mudd_folder
    folder = make_mudd_folder(tmp)
    words = ["now", "is", "the", "winter", "of", "our", "discontent", "made", "glorious",
             "summer", "by", "this", "sun"]
    rng = random.Random(0)
    (tmp / "essay.txt").write_text(" ".join(rng.choice(words) for _ in range(600)))
    return _cli(["audit", "--model", str(folder), "--data", str(tmp / "essay.txt"),
                 "--seq-len", "32", "--max-eval", "6", "--max-calib", "6", "--repeats", "1",
                 "--bootstrap", "50", "--timing-pairs", "0", "--dtype", "float32"],
                tmp / "mudd")


def tiny_moe(tmp: Path) -> Path:
    from fcaudit.models.moe import MoEConfig, MoEGPT
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16,
                             num_experts=4, top_k=2))
    fcaudit.audit(model, tmp / "moe", data=_toy_data(), options=AuditOptions(
        **FAST, frontier=True), report=False)
    return tmp / "moe" / "audit.json"


def mixtral(tmp: Path) -> Path:
    from conftest import FAMILIES, TEXT, save
    folder = save(FAMILIES["mixtral"][0](), tmp / "mixtral")
    rng = random.Random(0)  # varied windows: calibration and evaluation disjoint
    (tmp / "text.txt").write_text(" ".join(rng.choice(TEXT.split()) for _ in range(800)))
    return _cli(["audit", "--model", str(folder), "--data", str(tmp / "text.txt"),
                 "--seq-len", "12", "--max-eval", "8", "--max-calib", "8", "--repeats", "1",
                 "--bootstrap", "50", "--timing-pairs", "0", "--frontier",
                 "--frontier-points", "3", "--expert-ablation"], tmp / "mixtral-audit")


def vision(tmp: Path) -> Path:
    from fcaudit.io.digits import digits
    from fcaudit.models.vit_moe import ViTMoE, ViTMoEConfig
    torch.manual_seed(0)
    x, y = digits("eval")
    xc, _ = digits("calib")
    fcaudit.audit(ViTMoE(ViTMoEConfig(n_layer=4, n_head=2, n_embd=16)), tmp / "vision",
                  data=AuditData(inputs=x[:24], targets=y[:24], calib_inputs=xc[:16]),
                  options=AuditOptions(objective="classification", repeats=1, bootstrap=50,
                                       batch_size=8, timing_pairs=0, progress=False),
                  report=False)
    return tmp / "vision" / "audit.json"


def custom(tmp: Path) -> Path:
    import toys

    def halve(coefficients: dict[str, torch.Tensor], context: Any) -> dict[str, torch.Tensor]:
        return {k: v * 0.5 for k, v in coefficients.items()}

    fcaudit.audit(toys.content_model(), tmp / "custom", sites=["gates.*"], data=_toy_data(),
                  options=AuditOptions(**FAST, execution=False),
                  interventions={"halve": halve}, report=False)
    return tmp / "custom" / "audit.json"


def _built(arch: str, vocab: int | None = 64) -> torch.nn.Module:
    """A family's tiny preset from the model registry, random-initialised from seed 0."""
    from fcaudit.io.arches import get_arch
    torch.manual_seed(0)
    entry = get_arch(arch)
    return entry.build(entry.config("tiny", vocab)).eval()


def ours(arch: str, twin: str | None, data: Callable[[], AuditData] = _toy_data,
         **options: Any) -> Callable[[Path], Path]:
    """One of fcaudit's own families (and its twin), audited in memory on ``data``."""
    def run(tmp: Path) -> Path:
        vision = data is not _toy_data and data is not _copy_data
        model = _built(arch, None if vision else 64)
        dense = _built(twin, None if vision else 64) if twin else None
        fcaudit.audit(model, tmp / arch, dense=dense, data=data(),
                      options=AuditOptions(**{**FAST, **options}), report=False)
        return tmp / arch / "audit.json"
    return run


def _digits_data() -> AuditData:
    from fcaudit.io.digits import digits
    x, y = digits("eval")
    xc, _ = digits("calib")
    return AuditData(inputs=x[:24], targets=y[:24], calib_inputs=xc[:16])


def _copy_data() -> AuditData:
    from fcaudit.io import selective_copy
    ex, ey, cx, cy = selective_copy.audit_sets(selective_copy.preset("tiny"), 16, 16)
    return AuditData(inputs=ex, targets=ey, calib_inputs=cx, calib_targets=cy)


def hf_mamba(tmp: Path) -> Path:
    import numpy as np
    from ssm_families import VOCAB, build
    build("mamba").save_pretrained(tmp / "mamba")
    rng = np.random.default_rng(0)
    for name in ("eval", "calib"):
        np.save(tmp / f"{name}.npy", rng.integers(3, VOCAB, (8, 12)))
    return _cli(["audit", "--model", str(tmp / "mamba"), "--tokens", str(tmp / "eval.npy"),
                 "--calib-tokens", str(tmp / "calib.npy"), "--repeats", "1", "--bootstrap",
                 "50", "--batch-size", "4", "--timing-pairs", "0"], tmp / "hf-mamba")


def hf_early_exit(tmp: Path) -> Path:
    import numpy as np
    import transformers
    from conftest import COMMON, VOCAB, tokenizer_file
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 4},
                                      intermediate_size=64, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # confidences that straddle the threshold (tests/test_hf_early_exit)
        model.lm_head.weight.mul_(60.0)
    model.save_pretrained(tmp / "llama")
    tokenizer_file(tmp / "llama")
    rng = np.random.default_rng(0)
    for name in ("eval", "calib"):
        np.save(tmp / f"{name}.npy", rng.integers(3, VOCAB, (8, 12)))
    return _cli(["audit", "--model", str(tmp / "llama"), "--tokens", str(tmp / "eval.npy"),
                 "--calib-tokens", str(tmp / "calib.npy"), "--early-exit", "--exit-threshold",
                 "0.8", "--repeats", "1", "--bootstrap", "50", "--batch-size", "4",
                 "--timing-pairs", "0"], tmp / "hf-early-exit")


def target_ci(tmp: Path) -> Path:
    import toys
    pool = AuditData(toys.pair_sequences(24, 16, 1), toys.pair_sequences(12, 16, 2),
                     {"source": "tokens"})
    fcaudit.audit(toys.content_model(), tmp / "target", sites=["gates.*"], data=pool,
                  options=AuditOptions(**FAST, execution=False, target_ci=0.15,
                                       min_sequences=8), report=False)
    return tmp / "target" / "audit.json"


CASES: dict[str, Callable[[Path], Path]] = {
    "demo": demo, **{f"toy-{m}": toys_case(m) for m in
                     ("content", "constant", "position", "token_router", "context_router")},
    "mudd": mudd, "tiny-moe": tiny_moe, "mixtral": mixtral, "vision": vision, "custom": custom,
    "featuregate": ours("featuregate", "dense", frontier=True, frontier_points=3),
    "skipgate": ours("skipgate", "dense"),
    "mamba": ours("mamba", "s4d"),
    "mamba-selective-copy": ours("mamba", None, _copy_data, objective="selective-copy",
                                 execution=False),
    "earlyexit": ours("earlyexit", "dense", frontier_points=2),
    "ponder": ours("ponder", "dense-ponder", frontier_points=2),
    "tokenprune": ours("tokenprune", "dense-vit", _digits_data, batch_size=8),
    "condconv": ours("condconv", "dense-cnn", _digits_data, batch_size=8),
    "branchy": ours("branchy", "dense-cnn", _digits_data, batch_size=8, frontier_points=2),
    "hf-mamba": hf_mamba, "hf-early-exit": hf_early_exit, "target-ci": target_ci,
}


def stripped(audit: dict) -> dict:
    """audit.json without ``runtime``, the package version (a release is not a change of
    output) and the keys it lists as nondeterministic."""
    from conftest import strip_nondeterministic
    out = strip_nondeterministic(audit)
    out.pop("runtime", None)
    out.pop("fcaudit_version", None)
    return out


def canonical(name: str) -> dict:
    """Case ``name`` run in a fresh folder on one thread (the goldens' own setting: a sum
    split over threads may round differently), stripped, its folder spelled ``<tmp>``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            text = CASES[name](Path(tmp)).read_text().replace(tmp, "<tmp>")
    finally:
        torch.set_num_threads(threads)
    return stripped(json.loads(text))


def dumps(audit: dict) -> str:
    return json.dumps(audit, indent=1, sort_keys=True) + "\n"


def write(out: Path, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        if not only or name in only:
            (out / f"{name}.json").write_text(dumps(canonical(name)))
            print(f"wrote {out / name}.json", flush=True)


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """Removed or changed values of ``old`` in ``new`` (added keys are allowed)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key, value in old.items():
            if key not in new:
                found.append(f"{where}.{key}: removed")
            else:
                found += differences(value, new[key], f"{where}.{key}")
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True))
                for d in differences(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where}: {old!r:.120} -> {new!r:.120}"]


def compare(old_dir: Path, new_dir: Path) -> int:
    bad = 0
    for old in sorted(old_dir.glob("*.json")):
        new = new_dir / old.name
        if not new.exists():
            print(f"{old.stem}: missing in {new_dir}")
            bad += 1
            continue
        found = differences(stripped(json.loads(old.read_text())),
                            stripped(json.loads(new.read_text())))
        print(f"{old.stem}: {'identical outside runtime' if not found else 'DIFFERS'}")
        for line in found[:20]:
            print(f"  {line}")
        bad += bool(found)
    return bad


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "write":
        write(Path(sys.argv[2]), sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
