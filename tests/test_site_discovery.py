"""Site discovery (`fcaudit sites`): `--all` describes every module of a model, candidates
are judged by what their output multiplies, the watch follows a gate through casts, copies
and in-place ops, and what is not a controller (attention weights, TorchScript) is said."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import AUDIT_FAST, observed_outputs, run_inprocess
from torch import nn

from fcaudit.core.sites import NOT_CALLED, PROBE_TOKENS
from fcaudit.models.featuregate import GPT, PRESETS

# ------------------------------------------------------------------------ sites --all


def expected_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, tuple):
        return "tuple("
    return type(value).__name__


def module_lines(stdout: str) -> dict[str, str]:
    """`sites --all` module rows: path -> the rest of the line."""
    rows = [ln.strip().split("\t", 1) for ln in stdout.splitlines() if ln.startswith("  ")]
    return {path: rest for path, rest in rows}


def assert_every_module_described(stdout: str, model: nn.Module,
                                  probe: torch.Tensor | None = None) -> None:
    probe = torch.randint(0, 2, (2, PROBE_TOKENS)) if probe is None else probe
    reference = observed_outputs(model, probe)
    lines = module_lines(stdout)
    names = [n for n, _ in model.named_modules() if n]
    assert list(lines) == names  # one line per module, in module order
    assert len(reference) > 3
    for name in names:
        assert "not run" not in lines[name] and "failed" not in lines[name], (name, lines[name])
        if name in reference:
            assert expected_text(reference[name]) in lines[name], (name, lines[name])
        else:  # containers (ModuleList) are never called themselves
            assert lines[name].endswith(NOT_CALLED), (name, lines[name])
            assert isinstance(model.get_submodule(name), (nn.ModuleList, nn.ModuleDict))


def test_sites_all_describes_every_featuregate_module(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fgmodel.py").write_text(
        "import torch\nfrom fcaudit.models.featuregate import GPT, PRESETS\n\n\n"
        "def build():\n    torch.manual_seed(0)\n    return GPT(PRESETS['tiny']).eval()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = run_inprocess(["sites", "--model", "fgmodel:build", "--all"], capsys)
    assert res.returncode == 0, res.stderr
    torch.manual_seed(0)
    assert_every_module_described(res.stdout, GPT(PRESETS["tiny"]).eval())


def test_sites_all_describes_every_module_of_a_hugging_face_moe(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    from conftest import FAMILIES, save
    folder = save(FAMILIES["mixtral"][0](), tmp_path / "mixtral")
    res = run_inprocess(["sites", "--model", folder, "--all"], capsys)
    assert res.returncode == 0, res.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.config.use_cache = False
    assert_every_module_described(res.stdout, model)
    assert module_lines(res.stdout)["model.layers.0.mlp.gate"].endswith("<- site")


IMAGE_MODEL = """
import torch
from torch import nn


class Images(nn.Module):
    \"\"\"No declared sites; a mixing-weight generator by its name; takes images
    [B, 1, 8, 8].\"\"\"

    def __init__(self):
        super().__init__()
        self.mixer = nn.Linear(64, 3)
        self.kernels = nn.ModuleList(nn.Linear(64, 10) for _ in range(3))

    def forward(self, images):
        x = images.flatten(1)
        w = self.mixer(x).softmax(-1)
        return sum(w[:, k:k + 1] * e(x) for k, e in enumerate(self.kernels))


def build():
    torch.manual_seed(0)
    return Images().eval()
"""


def test_sites_all_probes_a_model_of_images_with_its_inputs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "imgmodel.py").write_text(IMAGE_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    x = np.random.default_rng(0).normal(size=(5, 1, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    argv = ["sites", "--model", "imgmodel:build", "--all"]
    res = run_inprocess([*argv, "--inputs", str(tmp_path / "x.npy")], capsys)
    assert res.returncode == 0, res.stderr
    import imgmodel
    assert_every_module_described(res.stdout, imgmodel.build(), torch.from_numpy(x[:2]))
    assert module_lines(res.stdout)["mixer"].endswith(
        "Tensor[2, 3] float32  <- likely controller ([B, ...] output; a softmax of its output "
        "that scales another branch: name its axes with --site-axes or a Site, see "
        "docs/method.md); kind: mixing weights")  # a softmax over its 3 kernels
    tokens = module_lines(run_inprocess(argv, capsys).stdout)  # token ids cannot feed it
    assert tokens["mixer"].startswith("Linear\tfailed: RuntimeError"), tokens["mixer"]


class _Breaks(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("needs attention_mask")


class _ThreeSteps(nn.Module):
    """emb runs, then block.inner raises, so head never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.block = nn.Sequential(nn.Identity(), _Breaks())
        self.head = nn.Linear(3, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(ids)))


def test_a_failed_pass_says_which_module_raised_and_what_never_ran() -> None:
    from fcaudit.core.sites import describe_modules
    rows = {r.path: r.output for r in describe_modules(_ThreeSteps(), set())}
    assert rows["emb"] == "Tensor[2, 7, 3] float32"
    assert rows["block.0"] == "Tensor[2, 7, 3] float32"
    assert rows["block.1"] == "failed: ValueError: needs attention_mask"
    assert rows["block"] == "failed (inside it, block.1 raised)"
    assert rows["head"] == ("not run: the forward pass stopped in block.1 (ValueError: needs "
                            "attention_mask)")
    assert set(rows) == {"emb", "block", "block.0", "block.1", "head"}


GATED_MLP = """
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d)
        self.down_proj, self.act_fn = nn.Linear(2 * d, d), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SE(nn.Module):  # a sigmoid gate computed functionally: its linear layer is the site
    def __init__(self, d):
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.score(x))


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mlp, self.se, self.norm = MLP(d), SE(d), nn.LayerNorm(d)

    def forward(self, x):
        return x + self.se(self.mlp(self.norm(x)))


class LM(nn.Module):
    def __init__(self, d=8, vocab=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(3))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build():
    torch.manual_seed(0)
    return LM().eval()
"""


def test_sites_judges_candidates_by_what_their_output_multiplies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A gated MLP's `act_fn` (its SiLU output multiplies `up_proj`'s) and an SE gate's
    scorer (its sigmoid scales the block) are candidates; `gate_proj`, a linear
    pre-activation, is not, whatever its name. The plain listing shows the candidates and
    the globs to audit them, --all every module."""
    (tmp_path / "gated.py").write_text(GATED_MLP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = run_inprocess(["sites", "--model", "gated:build"], capsys)
    assert res.returncode == 0, res.stderr
    listed = module_lines(res.stdout)
    expected = [f"layers.{i}.{m}" for i in range(3) for m in ("mlp.act_fn", "se.score")]
    assert sorted(listed) == sorted(expected)
    for i in range(3):
        assert listed[f"layers.{i}.mlp.act_fn"].endswith(  # SwiGLU's own nonlinearity
            "likely controller ([B, T, ...] output; a SiLU output that scales another "
            "branch); kind: activation")
        assert listed[f"layers.{i}.se.score"].endswith(  # sigmoid(Linear(d, 1)) * block
            "likely controller ([B, T, ...] output; a sigmoid of its output that scales "
            "another branch); kind: scalar gate")
    assert "suggested: fcaudit audit --sites 'layers.*.mlp.act_fn' ...  (activation)\n" \
        in res.stdout
    assert "suggested: fcaudit audit --sites 'layers.*.se.score' ...  (scalar gate)\n" \
        in res.stdout
    import gated
    total = len([n for n, _ in gated.build().named_modules() if n])
    assert f"6 likely controllers of {total} modules; --all lists every module" in res.stdout
    every = run_inprocess(["sites", "--model", "gated:build", "--all"], capsys)
    lines = module_lines(every.stdout)
    assert len(lines) == total
    assert "likely" not in lines["layers.0.mlp.gate_proj"]  # a linear pre-activation
    assert "likely" not in lines["layers.0.mlp.up_proj"]  # multiplied, but linear
    assert "likely" not in lines["embed"] and "likely" not in lines["layers.0.norm"]


def test_sites_finds_the_act_fn_of_a_hugging_face_llama(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    from conftest import COMMON, save
    folder = save(transformers.LlamaConfig(**COMMON, intermediate_size=64), tmp_path / "llama")
    res = run_inprocess(["sites", "--model", folder], capsys)
    assert res.returncode == 0, res.stderr
    listed = module_lines(res.stdout)
    assert {p for p in listed if p.endswith("mlp.act_fn")} == \
        {"model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"}
    assert not any(p.endswith("gate_proj") for p in listed)
    assert "suggested: fcaudit audit --sites 'model.layers.*.mlp.act_fn' ..." in res.stdout


HOSTILE = """
import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, d, kind):
        super().__init__()
        self.kind = kind
        self.score = nn.Sequential(nn.Linear(d, d), nn.Sigmoid())  # score.0 is linear
        self.gate = nn.Linear(d, d)

    def forward(self, x):
        if self.kind == "sequential":  # the gate is Sequential's index 1
            return x * self.score(x)
        if self.kind == "cast":  # a router's weights cast to the hidden dtype, then picked
            g = torch.sigmoid(self.gate(x)).to(torch.float64)[:, :, torch.arange(x.shape[-1])]
            return (x.double() * g).float()
        g = self.gate(x)  # an in-place sigmoid, then an in-place product
        g.sigmoid_()
        return x.clone().mul_(g)


class SEToken(nn.Module):
    \"\"\"A per-example channel gate [B, 8] on token states [B, T, 8].\"\"\"
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.Sigmoid()

    def forward(self, x):
        return x * self.act(self.fc(x.mean(1)))[:, None, :]


class SoftMixture(nn.Module):
    \"\"\"A dense (soft) mixture: a linear `router` and `experts`, no top-k anywhere.\"\"\"
    def __init__(self, d):
        super().__init__()
        self.router = nn.Linear(d, 4)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        weights = torch.softmax(self.router(x), -1)
        outs = torch.stack([e(x) for e in self.experts], -2)
        return torch.einsum("btk,btkd->btd", weights, outs)


class HardMask(nn.Module):
    \"\"\"A token-pruning scorer: tokens kept where the score is above 0 (no activation).\"\"\"
    def __init__(self, d):
        super().__init__()
        self.scorer = nn.Linear(d, 1)

    def forward(self, x):
        return x * (self.scorer(x) > 0).float()


class Scripted(nn.Module):
    \"\"\"A gate compiled with torch.jit.script: a TorchScript module takes no hooks.\"\"\"
    def __init__(self, d):
        super().__init__()
        self.gate = torch.jit.script(nn.Sequential(nn.Linear(d, d), nn.Sigmoid()))

    def forward(self, x):
        return x * self.gate(x)


class LM(nn.Module):
    def __init__(self, kind, d=8, vocab=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            {"se": SEToken, "soft": SoftMixture, "hard": HardMask, "scripted": Scripted}.get(
                kind, lambda d: Layer(d, kind))(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(kind):
    torch.manual_seed(0)
    return LM(kind).eval()


sequential, cast, inplace, se, soft, hard, scripted = (lambda k=k: build(k) for k in (
    "sequential", "cast", "inplace", "se", "soft", "hard", "scripted"))
"""


@pytest.fixture
def hostile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "hostile.py").write_text(HOSTILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_suggested_glob_names_the_candidates_alone_and_audits(
        hostile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`layers.N.score` is `Sequential(Linear, Sigmoid)`: the candidate is `score.1`, and
    `layers.*.score.*` would also audit the linear `score.0`; the suggestion keeps the
    `1` and widens the layer index only, and auditing with it records the two sigmoids."""
    import json
    res = run_inprocess(["sites", "--model", "hostile:sequential"], capsys)
    assert res.returncode == 0, res.stderr
    listed = module_lines(res.stdout)
    assert sorted(listed) == ["layers.0.score.1", "layers.1.score.1"]
    assert all(line.endswith("; kind: feature-wise gate") for line in listed.values())
    assert "suggested: fcaudit audit --sites 'layers.*.score.1' ..." in res.stdout
    assert "score.*" not in res.stdout
    np.save(hostile / "eval.npy", np.arange(48).reshape(6, 8) % 16)
    np.save(hostile / "calib.npy", (np.arange(48).reshape(6, 8) * 7) % 16)
    audit = run_inprocess(["audit", "--model", "hostile:sequential", "--sites",
                           "layers.*.score.1", "--tokens", "eval.npy", "--calib-tokens",
                           "calib.npy", "--out", "out", *AUDIT_FAST], capsys)
    assert audit.returncode == 0, audit.stderr
    sites = json.loads((hostile / "out" / "audit.json").read_text())["sites"]
    assert [(s["name"], s["kind"]) for s in sites] == [  # the audit judges as `sites` did
        ("layers.0.score.1", "feature-wise gate"), ("layers.1.score.1", "feature-wise gate")]


@pytest.mark.parametrize(("kind", "why"), [
    ("cast", "a sigmoid of its output that scales another branch"),  # cast + picked copy
    ("inplace", "a sigmoid of its output that scales another branch")])  # sigmoid_, mul_
def test_the_watch_follows_a_gate_through_casts_copies_and_in_place_ops(
        hostile: Path, capsys: pytest.CaptureFixture[str], kind: str, why: str) -> None:
    res = run_inprocess(["sites", "--model", f"hostile:{kind}"], capsys)
    assert res.returncode == 0, res.stderr
    listed = module_lines(res.stdout)
    assert sorted(listed) == ["layers.0.gate", "layers.1.gate"]
    assert listed["layers.0.gate"].endswith(  # sigmoid(Linear(d, d)) * x: per feature
        f"likely controller ([B, T, ...] output; {why}); kind: feature-wise gate")
    assert "suggested: fcaudit audit --sites 'layers.*.gate' ..." in res.stdout


def test_a_per_example_gate_of_a_token_model_is_not_read_as_positions(
        hostile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An SE gate `[B, 8]` on tokens: a probe of 8 tokens read its 8 channels as positions
    and suggested a glob the token audit refuses; it is per-example, and not suggested."""
    res = run_inprocess(["sites", "--model", "hostile:se"], capsys)
    assert res.returncode == 0, res.stderr
    listed = module_lines(res.stdout)
    assert sorted(listed) == ["layers.0.act", "layers.1.act"]
    assert listed["layers.0.act"] == (
        "Sigmoid\tTensor[2, 8] float32  <- likely per-example controller ([B, ...] output; "
        "a Sigmoid output that scales another branch; token ids are scored per token: "
        "audit it on --inputs, --targets and --calib-inputs); kind: feature-wise gate")
    assert PROBE_TOKENS != 8 and "suggested" not in res.stdout


class _NoMin(torch.Tensor):
    """A tensor subclass whose min/max raise: the watch cannot judge its values."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("min", "max"):
            raise RuntimeError("no min here")
        return super().__torch_function__(func, types, args, kwargs or {})


class _OddGate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x).as_subclass(_NoMin)


class _OddModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.gate, self.head = nn.Embedding(8, 4), _OddGate(), nn.Linear(4, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head((x * self.gate(x)).as_subclass(torch.Tensor))


def test_an_error_of_the_watch_falls_back_to_names_and_never_stops_the_pass() -> None:
    from fcaudit.core.sites import describe_modules
    rows = {r.path: (r.output, r.hint) for r in describe_modules(_OddModel(), set())}
    assert rows["head"][0] == f"Tensor[2, {PROBE_TOKENS}, 8] float32"  # the pass finished
    assert rows["gate"][1] == "likely controller ([B, T, ...] output)"  # by its name
    assert rows["embed"][1] == "" and rows["head"][1] == ""


def test_the_short_listing_says_when_the_probe_pass_did_not_finish(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Token ids into an image model (no --inputs): the pass stops in `blocks.0`. Before,
    the short listing said only "0 likely controllers of 7 modules", as for a model
    without any; now it says where the pass stopped and how to probe it."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    res = run_inprocess(["sites", "--model", "vision_toys:se_unequal"], capsys)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[-2] == "0 likely controllers of 7 modules; --all lists every module with " \
        "its output"
    assert lines[-1].startswith("the probe pass did not finish (blocks.0: failed: ")
    assert lines[-1].endswith("so the modules it did not reach were not judged; give two "
                              "inputs the model takes with --inputs X.npy (--all shows "
                              "every module)")
    np.save(tmp_path / "x.npy", np.zeros((2, 1, 8, 8), dtype=np.float32))
    given = run_inprocess(["sites", "--model", "vision_toys:se_unequal", "--inputs",
                           tmp_path / "x.npy"], capsys)
    assert given.returncode == 0 and "did not finish" not in given.stdout
    assert "suggested: fcaudit audit --sites 'blocks.*.gate' ..." in given.stdout


class _EinsumAttention(nn.Module):
    """Attention written with einsum (an nn.Softmax module's [B, H, T, T] output is an
    einsum operand, as a mixture's weights are), with as many heads as the probe has
    tokens, beside a real per-token gate."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads, width = heads, 2 * heads
        self.embed, self.qkv, self.head = nn.Embedding(16, width), \
            nn.Linear(width, 3 * width), nn.Linear(width, 16)
        self.softmax = nn.Softmax(-1)
        self.gate = nn.Sequential(nn.Linear(width, width), nn.Sigmoid())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, t, w = x.shape
        q, k, v = (z.view(b, t, self.heads, 2).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, -1))
        weights = self.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k))
        mixed = torch.einsum("bhqk,bhkd->bhqd", weights, v).transpose(1, 2).reshape(b, t, w)
        return self.head(mixed * self.gate(mixed))


@pytest.mark.parametrize("heads", [PROBE_TOKENS, 2])
def test_attention_weights_over_token_pairs_are_not_a_controller(heads: int) -> None:
    """Before: with as many heads as probe tokens the [2, T, T, T] softmax read as a
    "[B, T, ...]" controller (with 2 heads, once per-example gates were judged, as one of
    those); weights over token pairs are attention, the gate beside them is marked."""
    from fcaudit.core.sites import describe_modules
    t = PROBE_TOKENS
    hints = {r.path: (r.output, r.hint) for r in describe_modules(_EinsumAttention(heads), set())}
    assert hints["softmax"] == (f"Tensor[2, {heads}, {t}, {t}] float32", "")
    assert hints["gate.1"][1] == "likely controller ([B, T, ...] output; a Sigmoid output " \
        "that scales another branch)"
    assert [p for p, (_, h) in hints.items() if h] == ["gate.1"]
    kinds = {r.path: r.kind for r in describe_modules(_EinsumAttention(heads), set())}
    assert {p: k.name for p, k in kinds.items() if k} == {"gate.1": "feature-wise gate"}


def test_a_soft_mixture_without_top_k_is_judged_by_its_output_and_audits(
        hostile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A block with a linear `router` and `experts` but no top-k: before, discovery made
    it a router site whose audit failed with "give RouterAdapter(top_k=...)", which no
    flag can give; now the probe marks the router (its softmax weights the experts) and
    the suggested glob audits its [B, T, 4] logits."""
    import json
    res = run_inprocess(["sites", "--model", "hostile:soft"], capsys)
    assert res.returncode == 0, res.stderr
    assert "family=router" not in res.stdout
    listed = module_lines(res.stdout)
    assert sorted(listed) == ["layers.0.router", "layers.1.router"]
    assert listed["layers.0.router"] == (  # softmax weights over 4 experts, no top-k
        f"Linear\tTensor[2, {PROBE_TOKENS}, 4] float32  <- likely controller ([B, T, ...] "
        "output; a softmax of its output that scales another branch); kind: mixing weights")
    assert "suggested: fcaudit audit --sites 'layers.*.router' ..." in res.stdout
    np.save(hostile / "eval.npy", np.arange(48).reshape(6, 8) % 16)
    np.save(hostile / "calib.npy", (np.arange(48).reshape(6, 8) * 7) % 16)
    audit = run_inprocess(["audit", "--model", "hostile:soft", "--sites", "layers.*.router",
                           "--tokens", "eval.npy", "--calib-tokens", "calib.npy", "--out",
                           "out", *AUDIT_FAST], capsys)
    assert audit.returncode == 0, audit.stderr
    sites = json.loads((hostile / "out" / "audit.json").read_text())["sites"]
    assert [(s["name"], s["family"], s.get("adapter"), s["kind"]) for s in sites] == [
        (f"layers.{i}.router", "layers.*.router", None, "mixing weights")
        for i in range(2)]  # no RouterAdapter: soft weights over the experts


def test_a_hard_mask_scorer_is_a_controller(hostile: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`x * (scorer(x) > 0).float()`: before, a threshold was not followed (0 candidates);
    a mask kept where a score passes a threshold scales the tokens as a gate does."""
    res = run_inprocess(["sites", "--model", "hostile:hard"], capsys)
    assert res.returncode == 0, res.stderr
    listed = module_lines(res.stdout)
    assert listed == {f"layers.{i}.scorer": (
        f"Linear\tTensor[2, {PROBE_TOKENS}, 1] float32  <- likely controller ([B, T, ...] "
        "output; a threshold of its output that scales another branch); kind: scalar gate")
        for i in range(2)}
    assert "suggested: fcaudit audit --sites 'layers.*.scorer' ..." in res.stdout


def test_a_torchscript_module_is_listed_and_refused_as_a_site(
        hostile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `sites` and `audit --sites layers.*.gate` both stopped with "unexpected
    RuntimeError (register_forward_pre_hook is not supported on ScriptModules); this is a
    bug"; now `sites` lists them as not watched and the audit refuses in one line."""
    res = run_inprocess(["sites", "--model", "hostile:scripted", "--all"], capsys)
    assert res.returncode == 0, res.stderr
    listed = module_lines(res.stdout)
    assert listed["layers.0.gate"] == ("RecursiveScriptModule\tnot watched: a TorchScript "
                                       "module takes no hooks")
    assert listed["head"].startswith(f"Linear\tTensor[2, {PROBE_TOKENS}, 16]")
    np.save(hostile / "eval.npy", np.arange(48).reshape(6, 8) % 16)
    audit = run_inprocess(["audit", "--model", "hostile:scripted", "--sites",
                           "layers.*.gate", "--tokens", "eval.npy", "--calib-tokens",
                           "eval.npy", "--out", "out", *AUDIT_FAST], capsys)
    assert audit.returncode == 2
    assert audit.stderr.strip() == (
        "fcaudit: error: site layers.0.gate is a TorchScript module (RecursiveScriptModule), "
        "which takes no hooks: build the model without torch.jit.script for the audit")
    assert not (hostile / "out").exists()
