"""``fcaudit tasks``: the wrapper's requests per second against a plain lm-evaluation-harness
run of the same model, side by side in one run (docs/tasks.md).

A tiny Mixtral folder (random weights, routers spread; a word-level tokenizer) is audited
on random token ids, then a local multiple-choice task (DOCS questions, 4 choices each)
is scored four ways on the same loaded task: lm-evaluation-harness's own Hugging Face
model (``HFLM``, batch sizes 1 and 32), and fcaudit's model class under ``original`` (a
record pass per batch of requests of one token length) and under ``correct`` (a record
and an identity replay per batch). The ratios say what the wrapper costs; the
accuracies, that all read the same requests. Writes docs/results/tasks_overhead.json
(``--json`` elsewhere).

    python benchmarks/tasks_overhead.py [--docs N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from resultfile import ResultFile, add_json_option
from tokenizers import Tokenizer, models, pre_tokenizers

import fcaudit
from fcaudit.core.conditions import CORRECT, ORIGINAL
from fcaudit.engine.actions.harness import load_tasks, require_lm_eval
from fcaudit.engine.actions.tasks import evaluate_tasks
from fcaudit.engine.options import AuditOptions
from fcaudit.io.data import AuditData

VOCAB, LENGTH = 120, 16


def _folder(root: Path) -> tuple[Path, Tokenizer]:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(root / "mixtral")
    tok.save(str(root / "mixtral" / "tokenizer.json"))
    return root / "mixtral", tok


def _task(root: Path, docs: int) -> Path:
    rng = np.random.default_rng(0)
    folder = root / "tasks"
    folder.mkdir()
    with (folder / "mc.jsonl").open("w") as f:
        for _ in range(docs):
            words = rng.integers(0, VOCAB, 6)
            f.write(json.dumps({"q": " ".join(f"w{w}" for w in words[:4]),
                                "choices": [f"w{w}" for w in rng.integers(0, VOCAB, 4)],
                                "label": int(rng.integers(0, 4))}) + "\n")
    (folder / "mc.yaml").write_text(
        f"task: bench_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=200, help="questions (default 200)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_json_option(parser, "tasks_overhead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm_eval = require_lm_eval()
    from lm_eval.models.huggingface import HFLM
    record = ResultFile("tasks_overhead.py")
    record.start()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder, tok = _folder(root)
        tasks = _task(root, args.docs)
        rng = np.random.default_rng(1)
        data = AuditData(eval_ids=rng.integers(0, VOCAB, (16, LENGTH)),
                         calib_ids=rng.integers(0, VOCAB, (16, LENGTH)))
        fcaudit.audit(str(folder), root / "audit", data=data, report=False, options=AuditOptions(
            repeats=1, bootstrap=50, execution=False, per_layer=False, progress=False))
        done = evaluate_tasks(root / "audit", ["bench_choice"], data=data, tokenizer=tok,
                              include_path=tasks)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        plain = {}
        for batch in (1, 32):
            lm = HFLM(pretrained=model, tokenizer=transformers.PreTrainedTokenizerFast(
                tokenizer_object=tok, eos_token="w0"), batch_size=batch)
            loaded = load_tasks(["bench_choice"], tasks, 0)
            started = time.perf_counter()
            out = lm_eval.evaluator.evaluate(lm=lm, task_dict=loaded, log_samples=False,
                                             bootstrap_iters=0, verbosity="ERROR")
            plain[batch] = (time.perf_counter() - started,
                            out["results"]["bench_choice"]["acc,none"])
    requests = done.tasks["bench_choice"].requests[CORRECT]
    acc = done.tasks["bench_choice"].metrics["acc"].values
    plain_s = plain[1][0]
    rows = {"plain_lm_eval": {"seconds": plain_s, "requests_per_s": requests / plain_s,
                              "accuracy": plain[1][1]},
            "plain_lm_eval_32": {"seconds": plain[32][0],
                                 "requests_per_s": requests / plain[32][0],
                                 "accuracy": plain[32][1],
                                 "time_over_plain": plain[32][0] / plain_s}}
    for condition in (ORIGINAL, CORRECT):
        seconds = done.wall_s[condition]
        rows[condition] = {"seconds": seconds, "requests_per_s": requests / seconds,
                           "accuracy": acc[condition].value,
                           "time_over_plain": seconds / plain_s}
    for name, row in rows.items():
        print(f"{name}: {row['requests_per_s']:,.1f} requests/s, accuracy "
              f"{row['accuracy']:.3f}" + (f", {row['time_over_plain']:.2f}x the plain run's "
                                          "time" if "time_over_plain" in row else ""))
    record.write(args.json, {"model": "a tiny Mixtral (2 layers, 4 experts, top 2), random "
                             "weights", "docs": args.docs, "requests": requests,
                             "threads": args.threads, "runs": rows})


if __name__ == "__main__":
    main()
