"""Coefficient layouts proven, not guessed: a position axis is accepted only
where its length is the positions of what the module reads; otherwise the coefficients
are per-example, or the audit asks for the layout in one line. Planted models with
answers known by construction (tests/vision_toys.py: SEModel, PatchModel, SpatialModel)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import toys
import vision_toys as vt
from conftest import FAST_ARGS, run_inprocess
from torch import nn

import fcaudit
from fcaudit import AuditData, AuditOptions, Gate, Site
from fcaudit.api import audit
from fcaudit.core.errors import FcauditError
from fcaudit.core.layout import decide_layout, parse_axes, spell_axes
from fcaudit.core.sites import find_sites

FAST = dict(objective="classification", bootstrap=200, repeats=2, execution=False,
            progress=False, batch_size=8)
TOKEN_FAST = dict(bootstrap=50, repeats=1, execution=False, progress=False, batch_size=4,
                  per_layer=False)
NO_POSITION = {"shuffle", "reassign+shuffle", "static-layer-position"}


def image_audit(model: nn.Module, **kw: object) -> fcaudit.AuditResult:
    x, y = vt.image_data(16, 0)
    xc, _ = vt.image_data(16, 1)
    options = kw.pop("options", FAST)
    return fcaudit.audit(model, data=AuditData(inputs=x, targets=y, calib_inputs=xc),
                         options=AuditOptions(**options), **kw)


def token_audit(model: nn.Module, **kw: object) -> fcaudit.AuditResult:
    data = AuditData(toys.pair_sequences(8, 16, 1), toys.pair_sequences(4, 16, 2), {})
    options = AuditOptions(**{**TOKEN_FAST, **kw.pop("options", {})})
    return fcaudit.audit(model, data=data, options=options, **kw)


# ------------------------------------------------------------- the rules, shape by shape


def test_axes_are_spelled_as_the_report_marks_them() -> None:
    assert parse_axes("example,channel,row*,column*", "x") == (
        ("example", "channel", "row", "column"), (2, 3))
    assert parse_axes(" example , patch* ", "x") == (("example", "patch"), (1,))
    assert parse_axes(["example", "kernel"], "x") == (("example", "kernel"), ())
    assert spell_axes(("example", "row", "column"), (1, 2)) == "example,row*,column*"
    for bad in ("", "example*,token", "example,,token", "example,a,a*", "*"):
        with pytest.raises(FcauditError):
            parse_axes(bad, "x")


@pytest.mark.parametrize("shape, read, axes, positions", [
    ((8, 4), (8, 4, 8, 8), ("example", "channel"), ()),  # an SE gate: channels, not cells
    ((8, 4), None, ("example",), ()),  # an input without positions
    ((8, 16), (8, 16, 4), ("example", "patch"), (1,)),  # 16 patches of 4 features
    ((8, 16, 1), (8, 16, 4), ("example", "patch"), (1,)),
    ((8, 2, 4, 4), (8, 1, 4, 4), ("example", "channel", "row", "column"), (2, 3)),
    ((8, 4, 4), (8, 3, 4, 4), ("example", "row", "column"), (1, 2)),
    ((8, 16), (8, 3, 4, 4), ("example",), ()),  # flattened cells are not read as such
    ((8, 64), (8, 64, 8, 8), ("example", "channel"), ()),  # SE on 64 channels of 8x8
    ((8, 4), (8, 16, 4), ("example", "feature"), ()),  # pooled over 16 patches
    ((8, 2, 4, 4), (8, 1, 8, 8), ("example",), ()),  # not the input's 8x8 cells: unproven
    ((8, 4, 1, 1), (8, 4, 1, 1), ("example", "channel"), ()),  # a pooled map: one cell
])
def test_a_position_axis_only_where_the_input_has_those_positions(
        shape: tuple, read: tuple | None, axes: tuple, positions: tuple) -> None:
    site = Site("g", "g", "blocks.*.g", 0)
    decided, note = decide_layout(site, shape, read)
    assert (decided.axes, decided.positions) == (axes, positions)
    assert note.startswith("one value set per example" if not positions
                           else "positions proven")


@pytest.mark.parametrize("shape, read", [
    ((8, 16), (8, 16, 16)),  # 16 patches of 16 features: which one is axis 1?
    ((8, 8, 8), (8, 8, 8, 8)),  # [B, H, W] or [B, C, H] of 8 channels
    ((8, 8, 8, 8), (8, 8, 8, 8)),  # [B, H, W, ...] or [B, C, H, W]
])
def test_an_axis_as_long_as_a_width_is_refused_naming_the_declaration(
        shape: tuple, read: tuple) -> None:
    with pytest.raises(FcauditError) as caught:
        decide_layout(Site("blocks.0.g", "blocks.0.g", "blocks.*.g", 0), shape, read)
    assert "cannot tell which axes" in str(caught.value)
    assert "--site-axes 'blocks.*.g=" in caught.value.for_cli()
    assert "Site(..., axes=(" in str(caught.value) and "site_axes={'blocks.*.g'" in \
        str(caught.value)


# ------------------------------------------------------------- squeeze-and-excitation


@pytest.mark.parametrize("factory, widths", [(vt.se_equal, [4, 4]), (vt.se_unequal, [4, 6])])
def test_an_se_gate_named_by_a_glob_is_per_example(factory, widths: list[int]) -> None:
    """Before: equal widths read [B, C] as C positions (shuffle +0.522 nats "across
    tokens", static-layer averaged the channels: +2.313, as global-mean); unequal widths
    failed with "coefficients must map site names to tensors [B, T, ...]". The gate is
    the same for every example by construction (weight 0), so reassign feeds identical
    bits (exactly 0) and the static per-layer profile is that gate (exactly 0)."""
    r = image_audit(factory(), sites=["blocks.*.gate"])
    assert [(s.axes, s.positions, s.trailing_shape, s.kind) for s in r.sites] == [
        (["example", "channel"], [], [w], "feature-wise gate")  # a sigmoid per channel
        for w in widths]
    assert all(s.layout.startswith("one value set per example") for s in r.sites)
    assert set(r.not_applicable) >= NO_POSITION and not NO_POSITION & set(r.conditions)
    assert r.conditions["reassign"].delta == 0.0 and r.conditions["static-layer"].delta == 0.0
    assert r.conditions["global-mean"].ci95[0] > 1.0
    assert "shuffling is not applicable" in r.verdict.dependence
    assert "across tokens" not in r.verdict.dependence


def test_site_axes_and_site_objects_declare_the_se_layout() -> None:
    """The layout declared by a glob (site_axes) or by Site(axes=...): the user's names,
    no layout note (declared, not found); channels declared as positions are shuffled and
    the verdict says "across positions (channel)", not tokens."""
    by_glob = image_audit(vt.se_unequal(), sites=["blocks.*.gate"],
                          site_axes={"blocks.*.gate": "example,channel"})
    by_site = image_audit(vt.se_unequal(), sites=[
        Site(f"blocks.{i}.gate", f"blocks.{i}.gate", "se", i, axes=("example", "channel"),
             positions=()) for i in range(2)])
    for r in (by_glob, by_site):
        assert [(s.axes, s.positions, s.layout) for s in r.sites] == [
            (["example", "channel"], [], None)] * 2
        assert r.conditions["reassign"].delta == 0.0 and "shuffle" not in r.conditions
    insisted = image_audit(vt.se_equal(), sites=["blocks.*.gate"],
                           site_axes=["blocks.*.gate=example,channel*"])
    assert insisted.sites[0].positions == [1] and insisted.conditions["shuffle"].ci95[0] > 0
    assert "shuffling them across positions (channel)" in insisted.verdict.dependence


def test_site_axes_from_the_command_line(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # table cells on one line each
    x, y = vt.image_data(16, 0)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.save(tmp_path / "xc.npy", vt.image_data(16, 1)[0])
    base = ["audit", "--model", "vision_toys:se_unequal", "--sites", "blocks.*.gate",
            "--inputs", tmp_path / "x.npy", "--targets", tmp_path / "y.npy",
            "--calib-inputs", tmp_path / "xc.npy", "--objective", "classification",
            *FAST_ARGS]
    res = run_inprocess([*base, "--out", tmp_path / "a", "--site-axes",
                         "blocks.*.gate=example,[/]chan[bold]"], capsys)
    assert res.returncode == 0, res.stderr
    r = fcaudit.AuditResult.read(tmp_path / "a" / "audit.json")
    assert [(s.axes, s.positions) for s in r.sites] == [(["example", "[/]chan[bold]"], [])] * 2
    # rich markup in an axis name is printed as written, not read as a style
    assert "[example, [/]chan[bold]]" in " ".join(res.stdout.split())


# ------------------------------------------------------------- declared layouts win


def test_a_glob_over_declared_sites_keeps_their_layout() -> None:
    """Before: the glob kept the adapter but not the axes, so the spatial mask
    [B, 2, 4, 4] was read with its 2 channels as positions."""
    spatial = image_audit(vt.spatial_model(), sites=["mask"])
    assert (spatial.sites[0].axes, spatial.sites[0].positions,
            spatial.sites[0].trailing_shape) == (["example", "channel", "row", "column"],
                                                 [2, 3], [2])
    assert spatial.sites[0].layout is None
    assert spatial.conditions["shuffle"].ci95[0] > 0.3
    assert spatial.retention["static-layer-position"].value == 100.0
    x, y = vt.mixer_data(16, 0)
    mixer = fcaudit.audit(vt.class_mixer(), sites=["mi*"], data=AuditData(
        inputs=x, targets=y, calib_inputs=vt.mixer_data(16, 1)[0]), options=AuditOptions(**FAST))
    assert (mixer.sites[0].axes, mixer.sites[0].positions) == (["example", "kernel"], [])


def test_a_glob_keeps_what_the_model_declares_of_its_gate() -> None:
    class Declares(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.body = nn.Linear(2, 1), nn.Linear(2, 2)

        def controller_sites(self) -> list[Site]:
            return [Site("g", "gate", "own", 0, axes=("example", "patch"), positions=(1,),
                         role=Gate(float("-inf"), "body"))]

    (site,) = find_sites(Declares(), ["gat*"])
    assert (site.name, site.family, site.axes, site.positions, site.role) == (
        "gate", "gat*", ("example", "patch"), (1,), Gate(float("-inf"), "body"))


def test_site_axes_cannot_contradict_the_model() -> None:
    with pytest.raises(FcauditError, match="more than one layout .*declares example,channel,"
                                           "row\\*,column\\*"):
        image_audit(vt.spatial_model(), sites=["mask"], site_axes={"mask": "example,cell*"})


def test_site_axes_naming_the_trailing_axes_of_a_declared_layout_agree() -> None:
    """FeatureGate declares its gates `example,token*`; `example,token*,unit` says the same
    and names the trailing axis: before, "gives it more than one layout"; now it audits
    (the model's declaration kept). Other positions still contradict it."""
    r = token_audit(_tiny_gpt(), site_axes={"blocks.*.gate": "example,token*,unit"})
    assert [(s.name, s.axes) for s in r.sites] == [("blocks.0.gate", None),
                                                   ("blocks.1.gate", None)]
    assert "shuffle" in r.conditions
    with pytest.raises(FcauditError, match="more than one layout \\(blocks.\\*.gate="
                                           "example,unit\\*, and it declares example,token"):
        token_audit(_tiny_gpt(), site_axes={"blocks.*.gate": "example,unit*"})


@pytest.mark.parametrize(("site_axes", "got"), [
    ({"blocks.*.gate": ["example", 3]}, "got 'blocks.*.gate': ['example', 3]"),  # raw TypeError
    ({"blocks.*.gate": 5}, "got 'blocks.*.gate': 5"),
    ({"blocks.*.gate": None}, "got 'blocks.*.gate': None"),
    ({3: "example,channel"}, "got 3: 'example,channel'"),
    (5, "got 5"),  # before: "got ''"
    (["blocks.*.gate"], "got 'blocks.*.gate'")])
def test_a_site_axes_entry_of_the_wrong_type_is_one_line(site_axes: object,
                                                         got: str) -> None:
    with pytest.raises(FcauditError) as caught:
        image_audit(vt.se_unequal(), sites=["blocks.*.gate"], site_axes=site_axes)
    assert str(caught.value) == (
        "give site_axes={GLOB: AXES} for each glob of sites (AXES: comma-separated axis "
        "names), e.g. 'blocks.*.gate=example,channel' (one value set per example) or "
        f"'blocks.*.mask=example,channel,row*,column*'; {got}")


def test_a_family_declared_with_positions_of_unequal_lengths_is_refused_first(
        tmp_path: Path) -> None:
    """SE gates of widths 4 and 6 declared `example,channel*`: before, the whole audit ran
    and then crashed in the variance split ("The size of tensor a (4) must match the
    size of tensor b (6)"); now the first batch refuses it, naming both sites."""
    with pytest.raises(FcauditError) as caught:
        image_audit(vt.se_unequal(), sites=["blocks.*.gate"],
                    site_axes={"blocks.*.gate": "example,channel*"}, out=tmp_path / "out")
    assert str(caught.value).startswith(
        "sites of family blocks.*.gate have different numbers of positions (blocks.0.gate: "
        "4, blocks.1.gate: 6), so no position can be compared across them")
    assert "--site-axes, or name each site" in caught.value.for_cli()
    assert not (tmp_path / "out" / "audit.json").exists()
    equal = image_audit(vt.se_equal(), sites=["blocks.*.gate"],  # 4 and 4: as declared
                        site_axes={"blocks.*.gate": "example,channel*"})
    assert "shuffle" in equal.conditions


# ------------------------------------------------------------- patches, proven or not


class SquarePatches(nn.Module):
    """16 patches of 16 features: a [B, 16] gate could be per patch or per feature."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lift = nn.Linear(4, 16)
        self.gate = vt.PatchGate()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = self.lift(F.unfold(images, 2, stride=2).transpose(1, 2))  # [B, 16, 16]
        read = (self.gate(patches).unsqueeze(-1) * patches).sum(1).mean(-1)
        return torch.stack([-read, read], dim=1)


def test_a_patch_gate_is_proven_by_its_input() -> None:
    """PatchModel's gate [B, 16] reads patches [B, 16, 4]: axis 1 is the 16 patches; a
    Site without axes is decided as a glob is (shuffle then hurts as declared)."""
    r = image_audit(vt.patch_model(), sites=[Site("gate", "gate", "patch", 0)])
    assert (r.sites[0].axes, r.sites[0].positions) == (["example", "patch"], [1])
    assert r.sites[0].layout.startswith("positions proven")
    assert r.conditions["shuffle"].ci95[0] > 0.3 and r.conditions["reassign"].delta == 0.0


def test_an_undecidable_patch_gate_is_refused_then_declared() -> None:
    with pytest.raises(FcauditError, match="cannot tell which axes of its coefficients "
                                           "\\[B, 16\\] are positions") as caught:
        image_audit(SquarePatches(), sites=["gate"])
    assert "--site-axes 'gate=example,patch*'" in caught.value.for_cli()
    r = image_audit(SquarePatches(), sites=["gate"], site_axes={"gate": "example,patch*"})
    assert r.sites[0].positions == [1] and "shuffle" in r.conditions


class PatchesAndChannel(nn.Module):
    """PatchModel's gate [B, 16] beside a per-example gate [B, 1] (an SE gate on the one
    image channel, the same for every example): two layouts in one audit."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.se = vt.PatchGate(), vt.SEGate(1)
        self.scale = nn.Parameter(torch.tensor(6.0))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(images, 2, stride=2).transpose(1, 2)
        read = (self.gate(patches).unsqueeze(-1) * patches).sum(1).mean(-1) * \
            self.se(images)[:, 0]
        return torch.stack([-self.scale * read, self.scale * read], dim=1)


def test_patch_and_per_example_sites_in_one_audit() -> None:
    """Before: reassign refused the pair ("coefficients must map site names to tensors
    [B, T, ...] of one batch"). Now shuffle permutes the 16 patches only (it hurts: the
    class is read from patch 0), both gates are the same for every example (reassign
    exactly 0) and every per-position profile is the gate itself (exactly 0)."""
    r = image_audit(PatchesAndChannel().eval(), sites=["gate", "se"])
    assert [(s.axes, s.positions) for s in r.sites] == [(["example", "patch"], [1]),
                                                        (["example", "channel"], [])]
    assert r.conditions["reassign"].delta == 0.0
    assert r.conditions["static-layer-position"].delta == 0.0
    assert r.conditions["shuffle"].ci95[0] > 0.3
    mixed = {"a": torch.arange(24.0).view(4, 6), "b": torch.arange(4.0).view(4, 1)}
    swapped = fcaudit.reassign(mixed, [1, 0, 3, 2])
    assert torch.equal(swapped["b"], torch.tensor([[1.0], [0.0], [3.0], [2.0]]))
    assert torch.equal(swapped["a"][0], mixed["a"][1])


# ------------------------------------------------------------- token ids


def _tiny_gpt() -> nn.Module:
    from fcaudit.models.featuregate import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=toys.V, block_size=16, n_layer=2, n_head=2,
                         n_embd=16)).eval()


def test_a_token_gate_keeps_its_token_axis_when_the_width_equals_the_length() -> None:
    """FeatureGate's gate [B, T, 1] reads hidden states [B, 16, 16]: width = length, and
    the look one token shorter proves axis 1 is the tokens (shuffle still measured)."""
    r = token_audit(_tiny_gpt(), sites=["blocks.*.gate"])
    assert [(s.axes, s.positions, s.layout) for s in r.sites] == [(None, None, None)] * 2
    assert "shuffle" in r.conditions and not (r.not_applicable or {}).keys() & NO_POSITION
    content = token_audit(toys.content_model(), sites=["gates.*"])
    assert content.conditions["shuffle"].ci95[0] > 1.0


class PooledGate(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(h.mean(1))  # [B, T, d] -> [B, d]: one value set per sequence


class TokenSE(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.gate, self.head = nn.Embedding(toys.V, width), PooledGate(), \
            nn.Linear(width, toys.V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h * self.gate(h)[:, None, :])


def test_a_per_sequence_gate_as_wide_as_the_sequence_is_not_a_token_axis() -> None:
    """Before: [B, 16] on 16-token windows was audited as [B, T] (shuffle permuted the
    16 features); now the shorter look shows it stays 16 at 15 tokens."""
    with pytest.raises(FcauditError, match="its output \\[4, 16\\] at 16 tokens is "
                                           "\\[4, 16\\] at 15: its axis of 16 does not "
                                           "follow the sequence length"):
        token_audit(TokenSE(16), sites=["gate"])
    with pytest.raises(FcauditError, match="neither \\[batch=4, positions=16"):
        token_audit(TokenSE(8), sites=["gate"])


def test_a_declared_position_axis_on_tokens_must_follow_the_length() -> None:
    """`site_axes={'gate': 'example,channel*'}` on the [B, 16] gate of 16-token windows:
    before, the declaration skipped the proof and shuffle permuted 16 channels as
    "positions (channel)"; now it gets the undeclared site's proof. A real per-token gate
    declared under another axis name passes it."""
    with pytest.raises(FcauditError, match="its output \\[4, 16\\] at 16 tokens is "
                                           "\\[4, 16\\] at 15"):
        token_audit(TokenSE(16), sites=["gate"], site_axes={"gate": "example,channel*"})
    r = token_audit(toys.content_model(), sites=["gates.*"],
                    site_axes={"gates.*": "example,position*"})
    assert "shuffle" in r.conditions and r.conditions["shuffle"].ci95[0] > 1.0


def test_a_glob_over_whole_blocks(capsys) -> None:
    """An execution block that outputs the hidden states it reads is refused; an MLP (the
    hidden states it reads, in and out, scaling nothing) is audited as of kind "hidden
    states", said on the console and kept in the site's kind (no longer a warning in its
    layout note); gates counted as blocks (the toy's) are audited as ever."""
    with pytest.raises(FcauditError, match="site blocks.0 is one of the model's execution "
                                           "blocks and outputs the hidden states it reads "
                                           "\\[4, 16, 16\\]"):
        token_audit(_tiny_gpt(), sites=["blocks.*"])
    with pytest.raises(FcauditError, match="site blocks.0.body.mlp is one of the model's "):
        token_audit(_tiny_gpt(), sites=["blocks.*.body.mlp"], blocks="blocks.*.body.mlp")
    toy = token_audit(toys.content_model(), sites=["gates.*"], blocks="gates.*")
    assert all(s.layout is None for s in toy.sites) and toy.conditions["shuffle"].ci95[0] > 1
    capsys.readouterr()
    r = token_audit(_tiny_gpt(), sites=["blocks.*.body.mlp"], options={"progress": True})
    err = capsys.readouterr().err
    assert "fcaudit: sites blocks.*.body.mlp (2, e.g. blocks.0.body.mlp): kind hidden " \
           "states: a block's output, of the shape of the hidden states it reads" in err
    assert [(s.kind, s.layout) for s in r.sites] == [("hidden states", None)] * 2
    gates = token_audit(_tiny_gpt(), sites=["blocks.*.gate"])  # sigmoid [B, T, 1]
    assert [(s.kind, s.layout) for s in gates.sites] == [("scalar gate", None)] * 2


def test_markup_in_site_names_prints_literally(tmp_path: Path, capsys, monkeypatch) -> None:
    """print_summary shows names and axes as written: before, "[example, [bold]k[/]]" in
    a not-applicable reason was swallowed as a style and a stray "[/]" raised
    MarkupError."""
    from fcaudit.cli import print_summary
    monkeypatch.setenv("COLUMNS", "400")  # table cells on one line each
    x, y = vt.mixer_data(16, 0)
    r = fcaudit.audit(vt.class_mixer(), sites=[
        Site("[bold]mix[/]", "mix", "[/]", 0, axes=("example", "[bold]k[/]"), positions=())],
        data=AuditData(inputs=x, targets=y, calib_inputs=vt.mixer_data(16, 1)[0]),
        options=AuditOptions(**FAST))
    capsys.readouterr()
    print_summary(r, tmp_path)
    out = " ".join(capsys.readouterr().out.split())
    assert "[example, [bold]k[/]]" in out


def test_progress_bars_print_markup_literally() -> None:
    """On a terminal the rich bars printed stage and info as markup: "[/]" raised."""
    import io

    from fcaudit.report.progress import ProgressReporter

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    with ProgressReporter(True, stream) as progress:
        progress("record [/]x[bold]", 1, 2, "site [red]g[/]")
    assert "record [/]x[bold]" in stream.getvalue() and "site [red]g[/]" in stream.getvalue()


class _TimeMajorGate(nn.Module):
    """A gate whose output is [positions, batch, 1] (time-major), not [batch, positions]."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids.T.unsqueeze(-1) % 7).float() / 7


class _TimeMajorModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gates = nn.ModuleList([_TimeMajorGate()])
        self.emb = nn.Embedding(toys.V, toys.V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) * self.gates[0](ids).transpose(0, 1)


@pytest.mark.parametrize("size", [2, 4])
def test_a_time_major_gate_is_refused_even_when_batch_equals_length(size: int,
                                                                    tmp_path: Path) -> None:
    ids = toys.pair_sequences(3 * size, size, 1)
    data = AuditData(ids[:2 * size], ids[2 * size:], {})
    options = AuditOptions(batch_size=size, repeats=1, bootstrap=10, per_layer=False,
                           execution=False, progress=False)
    with pytest.raises(FcauditError) as caught:  # batch == positions: the shapes alone agree
        audit(_TimeMajorModel(), tmp_path / "out", sites=["gates.*"], data=data,
              options=options)
    message = str(caught.value)
    assert "\n" not in message and "site gates.0" in message, message
    assert f"with {size + 1} sequences of {size} tokens; with {size} of {size} the shape " \
        "fitted only because the two counts are equal: are the output's axes [positions, " \
        "batch, ...]?" in message
    assert not (tmp_path / "out").exists()
