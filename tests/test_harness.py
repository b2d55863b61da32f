"""Benchmark tasks under the audit's conditions (engine/actions/harness.py, engine/actions/tasks.py,
engine/analyses/tasks.py), through lm-evaluation-harness on local tasks this test writes
(nothing downloads).

Planted truth, with the hand-made toys of tests/toys.py read through a word-level
tokenizer (word ``wK`` is token ``K``): the multiple-choice task asks for the successor
of a token. The ``content`` toy predicts it only through gates that carry the token, so
under ``static-layer`` its accuracy falls to chance; the ``constant`` toy's gates are
constants, so nothing changes. The rolling task's perplexity under ``correct`` is
checked against the toy's log-probabilities computed here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import toys

pytest.importorskip("lm_eval")

import fcaudit  # noqa: E402
from fcaudit import AuditData, AuditOptions  # noqa: E402

V = toys.V
OPTIONS = AuditOptions(repeats=1, bootstrap=50, batch_size=8, execution=False,
                       progress=False, per_layer=False)
DOCS = 40


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _tasks(root: Path) -> Path:
    """A multiple-choice task (the successor of a token, or a distractor, in random
    order) and a rolling log-likelihood task (pair sequences as words), as YAML with
    local data."""
    rng = np.random.default_rng(0)
    root.mkdir()
    with (root / "mc.jsonl").open("w") as f:
        for t in rng.integers(0, V, DOCS):
            right, wrong = f"w{(t + 1) % V}", f"w{(t + 7) % V}"
            label = int(rng.integers(0, 2))
            f.write(json.dumps({"q": f"w{t}", "choices": [right, wrong][::1 - 2 * label],
                                "label": label}) + "\n")
    with (root / "text.jsonl").open("w") as f:
        for row in toys.pair_sequences(6, 24, 5):
            f.write(json.dumps({"text": " ".join(f"w{i}" for i in row)}) + "\n")
    (root / "mc.yaml").write_text(
        f"task: toy_successor\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    with (root / "long.jsonl").open("w") as f:  # a question of 40 words: past 32 positions
        f.write(json.dumps({"q": " ".join(["w1"] * 40), "choices": ["w2", "w3"], "label": 0})
                + "\n")
    (root / "long.yaml").write_text(
        f"task: toy_long\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'long.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    (root / "cloze.yaml").write_text(  # the same questions, the right answer as a cloze
        f"task: toy_cloze\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'mc.jsonl'}\ntest_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: \"{{' ' + choices[label]}}\"\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")  # lambada's own form
    (root / "group.yaml").write_text("group: toy_group\ntask:\n  - toy_successor\n"
                                     "  - toy_text\n")
    (root / "text.yaml").write_text(
        f"task: toy_text\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'text.jsonl'}\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    return root


@pytest.fixture(scope="module")
def audits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    import os

    import datasets.config
    root = tmp_path_factory.mktemp("harness")
    # the tasks' local data are cached here, not in the user's datasets cache (which
    # might also hold a hub task's data the offline refusal below expects to be missing)
    os.environ["HF_DATASETS_CACHE"] = str(root / "hf-cache")
    datasets.config.HF_DATASETS_CACHE = root / "hf-cache"
    data = AuditData(eval_ids=toys.pair_sequences(16, 16, 1),
                     calib_ids=toys.pair_sequences(16, 16, 2))
    out = {}
    for mode in ("content", "constant"):
        model = getattr(toys, f"{mode}_model")()
        fcaudit.audit(model, root / mode, sites=["gates.*"], data=data, options=OPTIONS,
                      report=False)
        out[mode] = (root / mode, model, data)
    return {"tasks": _tasks(root / "tasks"), **out}


def _evaluate(audits: dict, mode: str, tasks: list[str]):
    from fcaudit.engine.actions.tasks import evaluate_tasks
    folder, model, data = audits[mode]
    return evaluate_tasks(folder, tasks, model=model, data=data, tokenizer=_tokenizer(),
                          include_path=audits["tasks"])


def test_the_gate_carrying_the_answer_falls_to_chance_under_static_layer(audits) -> None:
    done = _evaluate(audits, "content", ["toy_successor"])
    acc = done.tasks["toy_successor"].metrics["acc"]
    assert acc.values["correct"].value == 1.0 and acc.values["original"].value == 1.0
    # a static gate carries no token: the choices score by calibration's token counts,
    # not by the question: chance (0.5) lies in the interval, far below correct's 1.0
    # under reassign the gates carry another document's token: chance too
    for profile in ("static-layer", "static-layer-position", "global-mean", "reassign"):
        lo, hi = acc.values[profile].ci95
        assert lo <= 0.5 <= hi and acc.penalty[profile].ci95[1] < 0, profile
    # a question is one token fed: shuffle has one position to permute, so it changes
    # nothing, and reassign+shuffle is reassign
    assert acc.values["shuffle"] == acc.values["correct"]
    assert acc.values["reassign+shuffle"] == acc.values["reassign"]
    assert done.tasks["toy_successor"].examples == DOCS
    assert all(n == 2 * DOCS for n in done.tasks["toy_successor"].requests.values())


def test_a_gate_that_does_not_carry_it_changes_nothing(audits) -> None:
    done = _evaluate(audits, "constant", ["toy_successor"])
    acc = done.tasks["toy_successor"].metrics["acc"]
    assert {c: e.value for c, e in acc.values.items()} == {c: 1.0 for c in done.conditions}
    assert all(e.value == 0.0 for e in acc.penalty.values())


def test_rolling_perplexity_is_the_toy_s_own(audits) -> None:
    import torch
    done = _evaluate(audits, "content", ["toy_text"])
    ppl = done.tasks["toy_text"].metrics["word_perplexity"]
    _, model, _ = audits["content"]
    total, words = 0.0, 0
    for line in (audits["tasks"] / "text.jsonl").read_text().splitlines():
        ids = [int(w[1:]) for w in json.loads(line)["text"].split()]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids[:-1]])).double()[0], -1)
        total += float(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
        words += len(ids)
    assert ppl.values["correct"].value == pytest.approx(math.exp(-total / words), rel=1e-9)
    assert ppl.higher_is_better is False
    assert ppl.penalty["static-layer"].value > 0  # a worse perplexity without the gates
    # the gates carry each position's token: permuted within a window, they mislead
    assert ppl.penalty["shuffle"].ci95[0] > 0
    assert "reassign" not in ppl.values  # a document's windows have no donor
    assert "had no donor" in done.tasks["toy_text"].not_applicable["reassign"]


def test_a_cloze_task_s_perplexity_is_the_harness_s_own_aggregate(audits) -> None:
    """lm-eval's ``perplexity`` is exp(-mean log-likelihood) over the examples, not a mean
    of per-example values: checked against the toy's log-probabilities computed here."""
    import torch
    done = _evaluate(audits, "content", ["toy_cloze"])
    scores = done.tasks["toy_cloze"].metrics
    _, model, _ = audits["content"]
    lls = []
    for line in (audits["tasks"] / "mc.jsonl").read_text().splitlines():
        doc = json.loads(line)
        q, a = int(doc["q"][1:]), int(doc["choices"][doc["label"]][1:])
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([[q]])).double()[0, -1], -1)
        lls.append(float(lp[a]))
    assert scores["perplexity"].values["correct"].value == \
        pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-9)
    assert scores["perplexity"].higher_is_better is False
    assert scores["acc"].values["correct"].value == 1.0  # the successor is the greedy token
    lo, hi = scores["perplexity"].values["static-layer"].ci95
    assert scores["perplexity"].values["correct"].value < lo <= hi


@pytest.mark.parametrize("seed", range(200))
def test_every_donor_is_of_another_document_and_each_gives_once(seed: int) -> None:
    """Against the exact condition for such an assignment to exist: no document holds
    more than half of the requests."""
    from fcaudit.engine.actions.harness import donors
    rng = np.random.default_rng(seed)
    docs = [("t", int(d)) for d in rng.integers(0, rng.integers(1, 6), rng.integers(1, 12))]
    given = donors(docs, np.random.default_rng(seed))
    largest = max(docs.count(d) for d in docs)
    if 2 * largest > len(docs):
        assert given is None
        return
    assert sorted(given) == list(range(len(docs)))
    assert all(docs[g] != docs[i] for i, g in enumerate(given))


def _featuregate_run(folder: Path) -> Path:
    """A tiny FeatureGate run folder (random weights) with the word-level tokenizer."""
    import dataclasses

    import torch

    from fcaudit.io.loading import save_run_model
    from fcaudit.models.featuregate import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=V, block_size=32, n_layer=2, n_head=2, n_embd=16)
    folder.mkdir()
    save_run_model(folder, GPT(cfg))
    (folder / "tokenizer.json").write_text(_tokenizer().to_str())
    (folder / "config.json").write_text(json.dumps({
        "fcaudit_run": 1, "arch": "featuregate", "preset": "tiny", "seed": 0,
        "model_config": dataclasses.asdict(cfg)}))
    return folder


def test_the_command_line_prints_each_condition_and_refuses_what_it_cannot_run(
        audits, tmp_path, capsys) -> None:
    from conftest import run_inprocess
    run = _featuregate_run(tmp_path / "run")
    np.save(tmp_path / "eval.npy", toys.pair_sequences(8, 16, 1))
    np.save(tmp_path / "calib.npy", toys.pair_sequences(8, 16, 2))
    data = ["--tokens", str(tmp_path / "eval.npy"), "--calib-tokens", str(tmp_path / "calib.npy")]
    audit_argv = ["audit", "--model", str(run), *data, "--repeats", "1", "--bootstrap", "50",
                  "--no-per-layer", "--no-execution", "--quiet", "--lm-eval-include-path",
                  str(audits["tasks"])]
    audit = run_inprocess([*audit_argv, "--out", str(tmp_path / "a"), "--lm-eval-tasks",
                           "toy_successor", "--lm-eval-limit", "10"], capsys)
    assert audit.returncode == 0, audit.stderr
    bad = run_inprocess([*audit_argv, "--out", str(tmp_path / "b"), "--lm-eval-tasks",
                         "toy_successor,nope"], capsys)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--lm-eval-tasks nope: lm-evaluation-harness knows no such task (give a task's " \
        "YAML folder with --lm-eval-include-path)" in bad.stderr
    assert not (tmp_path / "b").exists()
    long = run_inprocess([*audit_argv, "--out", str(tmp_path / "b"), "--lm-eval-tasks",
                          "toy_long"], capsys)
    assert long.returncode == 2 and len(long.stderr.strip().splitlines()) == 1, long.stderr
    assert "--lm-eval-tasks toy_long: a request of 41 tokens reads 40 positions, beyond the " \
        "model's context of 32" in long.stderr
    assert not (tmp_path / "b").exists()
    argv = ["tasks", "--audit", str(tmp_path / "a"), *data, "--include-path",
            str(audits["tasks"]), "--quiet"]
    res = run_inprocess([*argv, "--tasks", "toy_successor", "--limit", "10", "--json",
                         str(tmp_path / "tasks.json")], capsys)
    assert res.returncode == 0, res.stderr
    scores = json.loads((tmp_path / "tasks.json").read_text())["tasks"]["toy_successor"]
    assert scores["examples"] == 10
    # the audit's own section: the same scores (its calibration profiles, recomputed here)
    in_audit = json.loads((tmp_path / "a" / "audit.json").read_text())["tasks"]
    assert in_audit["tasks"]["toy_successor"] == scores
    for condition, value in scores["metrics"]["acc"]["values"].items():
        lo, hi = value["ci95"]
        assert f"| {condition} | {value['value']:.4f} [{lo:.4f}, {hi:.4f}] |" in res.stdout
    # a group stands for its tasks, each scored as when named alone
    group = run_inprocess([*argv, "--tasks", "toy_group", "--limit", "10", "--json",
                           str(tmp_path / "group.json")], capsys)
    assert group.returncode == 0, group.stderr
    grouped = json.loads((tmp_path / "group.json").read_text())["tasks"]
    assert set(grouped) == {"toy_successor", "toy_text"}
    assert grouped["toy_successor"] == scores
    gen = audits["tasks"] / "gen.yaml"
    gen.write_text(f"task: toy_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                   f"    test: {audits['tasks'] / 'mc.jsonl'}\ntest_split: test\n"
                   "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: label\n"
                   "metric_list:\n  - metric: exact_match\n")
    for task, said in (("toy_gen", "--tasks toy_gen is a generate_until task"),
                       ("nope", "--tasks nope: lm-evaluation-harness knows no such task"),
                       ("piqa", "could not load piqa offline")):  # its data: on the hub
        bad = run_inprocess([*argv, "--tasks", task], capsys)
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def _in_audit(audits: dict, mode: str, out: Path, **options):
    """The toy audited with the benchmark tasks in the audit itself (a LoadedModel carries
    the word-level tokenizer)."""
    import dataclasses
    folder, model, data = audits[mode]
    loaded = fcaudit.LoadedModel(model, f"toys:{mode}", "module", tokenizer=_tokenizer())
    opts = dataclasses.replace(OPTIONS, lm_eval_include_path=str(audits["tasks"]), **options)
    return fcaudit.audit(loaded, out, sites=["gates.*"], data=data, options=opts)


def test_an_audit_scores_the_tasks_beside_its_nll_answers(audits, tmp_path) -> None:
    """``--lm-eval-tasks``: the section in audit.json (read back strictly), the report,
    metrics() with intervals, to_frame("tasks") and compare, every number against the
    same tasks scored on the finished audit by fcaudit tasks."""
    result = _in_audit(audits, "content", tmp_path / "a",
                       lm_eval_tasks=("toy_successor", "toy_text"), lm_eval_limit=30)
    back = fcaudit.AuditResult.read(tmp_path / "a" / "audit.json")
    section = back.analyses["tasks"]
    assert section == result.analyses["tasks"]
    # said in the plan before the work: at most a record and a replay per pass and
    # condition: the 60 requests of 30 questions (the limit) of two choices read one
    # position each, in batches of the audit's positions (its batch of 16-token windows),
    # and the 6 texts of 24 words one window each (the toy states no context)
    stage = result.runtime.plan["stages"]["benchmark task requests"]
    scored = len(section.conditions)
    batches = -(-60 // (OPTIONS.batch_size * 16))
    assert stage["passes"] == 2 * (batches + 6) * scored and stage["at_most"] is True
    assert stage["estimated_s"] > 0
    for name, t in section.tasks.items():  # reassign has no donor for a text's windows
        assert t.requests == {c: 0 if name == "toy_text" and c.startswith("reassign") else
                              {"toy_successor": 60, "toy_text": 6}[name]
                              for c in section.conditions}, name
    alone = _evaluate(audits, "content", ["toy_successor", "toy_text"])
    acc = section.tasks["toy_successor"].metrics["acc"]
    assert acc.values["correct"].value == 1.0 and section.tasks["toy_successor"].examples == 30
    assert alone.tasks["toy_successor"].examples == DOCS  # without the limit: every one
    lo, hi = acc.values["static-layer"].ci95
    assert lo <= 0.5 <= hi  # the planted truth: chance without the gates
    # the rolling task has fewer documents than the limit: scored whole in both, the audit's
    # own profiles and those fcaudit tasks recomputes give the same numbers
    assert section.tasks["toy_text"] == alone.tasks["toy_text"]
    metrics, intervals = back.metrics(), back.metric_intervals()
    frame = back.to_frame("tasks")
    rows = 0
    for task, scores in section.tasks.items():
        for metric, m in scores.metrics.items():
            for condition, value in m.values.items():
                key = f"tasks_{task}_{metric}_{condition}"
                assert metrics[key] == value.value and intervals[key] == list(value.ci95)
                row = frame[(frame.task == task) & (frame.metric == metric)
                            & (frame.condition == condition)]
                assert len(row) == 1 and row.value.item() == value.value
                assert (row.value_ci_low.item(), row.value_ci_high.item()) == tuple(value.ci95)
                rows += 1
            for profile, share in m.retention.items():
                assert metrics[f"tasks_{task}_{metric}_retention_{profile}"] == (
                    None if share is None else share.value)
            for condition, diff in m.penalty.items():
                key = f"tasks_{task}_{metric}_penalty_{condition}"
                assert metrics[key] == diff.value and intervals[key] == list(diff.ci95)
    assert len(frame) == rows
    report = (tmp_path / "a" / "report.md").read_text()
    assert "## Benchmark tasks (lm-evaluation-harness)" in report
    assert section.markdown() in report
    both = fcaudit.compare([tmp_path / "a", tmp_path / "a"], labels=["x", "y"])
    task_rows = {r["name"]: r for r in both.tables["quantities"] if r["kind"] == "analysis"}
    assert set(task_rows) == {k for k in metrics if k.startswith("tasks_")}
    markdown = both.to_markdown()
    for key, r in task_rows.items():
        assert (r["models"]["x"] or {}).get("value") == metrics[key]
        assert f"| `{key}` |" in markdown


def test_an_audit_refuses_tasks_before_any_work(audits, tmp_path) -> None:
    """A task lm-eval does not know, one of another kind and task options without tasks:
    refused before the model loads; a model without a tokenizer: before any file."""
    import dataclasses
    folder, model, data = audits["content"]
    local = str(audits["tasks"])
    for options, said in (
            (dict(lm_eval_tasks=("nope",), lm_eval_include_path=local),
             "lm_eval_tasks='nope'): lm-evaluation-harness knows no such task"),
            # the local task is found only under its folder
            (dict(lm_eval_tasks=("toy_successor",)), "lm_eval_tasks='toy_successor'): "
             "lm-evaluation-harness knows no such task (give a task's YAML folder with "
             "AuditOptions(lm_eval_include_path=...))"),
            (dict(lm_eval_limit=3), "is read only with lm_eval_tasks="),
            (dict(lm_eval_include_path=local), "is read only with lm_eval_tasks="),
            (dict(lm_eval_tasks="toy_successor"), "give task names"),
            (dict(lm_eval_tasks=("toy_successor",), lm_eval_limit=0), "at least 1"),
            (dict(lm_eval_tasks=("toy_successor",), engine="vllm"),
             "benchmark tasks are scored in PyTorch")):
        opts = dataclasses.replace(OPTIONS, **options)
        with pytest.raises(fcaudit.UsageError, match=said.replace("(", r"\(")
                           .replace(")", r"\)")):
            fcaudit.audit("no/such/model", tmp_path / "x", data=data, options=opts)
    opts = dataclasses.replace(OPTIONS, lm_eval_include_path=str(audits["tasks"]),
                               lm_eval_tasks=("toy_successor",))
    with pytest.raises(fcaudit.UsageError, match="this model has none"):
        fcaudit.audit(model, tmp_path / "y", sites=["gates.*"], data=data, options=opts)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_harness_s_own_entry_point_scores_as_fcaudit_does(audits) -> None:
    """``conditioned_model`` is an lm-eval model: ``lm_eval.simple_evaluate`` on it gives
    the accuracy ``evaluate_tasks`` gives under the same condition; a condition the audit
    did not run, or one not fed to requests, is refused naming those that are."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    folder, model, data = audits["content"]
    alone = _evaluate(audits, "content", ["toy_successor"])
    manager = TaskManager(include_path=str(audits["tasks"]), include_defaults=False)
    for condition in ("static-layer", "correct"):
        with fcaudit.conditioned_model(folder, condition, model=model, data=data,
                                       tokenizer=_tokenizer()) as lm:
            out = lm_eval.simple_evaluate(model=lm, tasks=["toy_successor"],
                                          task_manager=manager, bootstrap_iters=0)
        want = alone.tasks["toy_successor"].metrics["acc"].values[condition].value
        assert out["results"]["toy_successor"]["acc,none"] == want
    for condition, said in (("fixed-exit", "not feed it to task requests"),
                            ("nope", "no condition of fcaudit's")):
        with pytest.raises(fcaudit.UsageError, match=said), fcaudit.conditioned_model(
                folder, condition, model=model, data=data, tokenizer=_tokenizer()):
            pass


def test_random_conditions_are_averaged_over_the_audit_s_repeats(audits, tmp_path) -> None:
    """An audit of two repeats scores reassign and shuffle twice (seeds s and s + 1) and
    averages each example's item: its accuracy is the mean of the two one-draw accuracies
    that audits of one repeat give with seeds 0 and 1."""
    import dataclasses

    from fcaudit.engine.actions.tasks import evaluate_tasks
    folder, model, data = audits["content"]
    fcaudit.audit(model, tmp_path / "two", sites=["gates.*"], data=data, report=False,
                  options=dataclasses.replace(OPTIONS, repeats=2))

    def acc(audit: Path, seed: int) -> dict:
        done = evaluate_tasks(audit, ["toy_successor"], model=model, data=data,
                              tokenizer=_tokenizer(), include_path=audits["tasks"], seed=seed)
        return {c: e.value for c, e in done.tasks["toy_successor"].metrics["acc"].values.items()}

    two, first, second = acc(tmp_path / "two", 0), acc(folder, 0), acc(folder, 1)
    assert first["reassign"] != second["reassign"]  # the draws differ: the mean is a test
    for condition in ("reassign", "reassign+shuffle"):
        assert two[condition] == pytest.approx((first[condition] + second[condition]) / 2,
                                               abs=1e-12), condition
    for condition in ("correct", "static-layer", "global-mean"):  # one draw: as before
        assert two[condition] == first[condition], condition


def test_items_are_averaged_over_draws_or_refused() -> None:
    """A random condition's draws: numbers averaged, each number of a tuple too (a
    weighted perplexity's pair); an item that is neither is refused in one line."""
    from fcaudit.core.errors import DataError
    from fcaudit.engine.actions.harness import _mean_items
    assert _mean_items([[1, (2.0, 3)], [0, (4.0, 5)]]) == [0.5, (3.0, 4.0)]
    assert _mean_items([["a", 1]]) == ["a", 1]  # one draw: as it is
    with pytest.raises(DataError, match=r"cannot be averaged .* AuditOptions\(repeats=1\)"):
        _mean_items([["a"], ["b"]])
