"""The benchmark tasks of the ``tasks`` study, built from the built-in corpus's evaluation
works (never trained on) as lm-evaluation-harness task YAMLs with local data:

- ``shakespeare_next_word`` (multiple choice): a passage of :data:`CONTEXT_WORDS` words,
  and its next word among three distractors drawn from the evaluation works' common words
  (accuracy; chance 25%);
- ``shakespeare_cloze`` (log-likelihood, LAMBADA's form): the same passages, the next
  word as the continuation (whether it is the model's greedy choice, and the perplexity
  of the right word).

Seeded and written once per study folder (the same bytes on every machine); an existing
folder that holds other bytes is refused, never overwritten.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from fcaudit.core.errors import UsageError
from fcaudit.io.data import builtin_documents

NEXT_WORD, CLOZE = "shakespeare_next_word", "shakespeare_cloze"
TASKS = (NEXT_WORD, CLOZE)
EXAMPLES = 120  # per task: 600 requests per condition, about a minute on 2 cores
CONTEXT_WORDS = 24
CHOICES = 4
MIN_COUNT = 5  # a distractor is a word the evaluation works use at least this often


def passages(n: int = EXAMPLES, seed: int = 0) -> list[dict[str, object]]:
    """``n`` passages of the evaluation works, each with its next word among distractors
    (``choices``, the right one at ``label``)."""
    works = [doc.text.split() for doc in builtin_documents("eval")]
    counts = Counter(w for words in works for w in words)
    common = sorted(w for w, c in counts.items() if c >= MIN_COUNT)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = works[int(rng.integers(len(works)))]
        at = int(rng.integers(CONTEXT_WORDS, len(words)))
        answer = words[at]
        others: list[str] = []
        while len(others) < CHOICES - 1:
            w = common[int(rng.integers(len(common)))]
            if w != answer and w not in others:
                others.append(w)
        label = int(rng.integers(CHOICES))
        out.append({"context": " ".join(words[at - CONTEXT_WORDS:at]),
                    "choices": others[:label] + [answer] + others[label:], "label": label})
    return out


def _yaml(task: str, data: Path, kind: str, body: str) -> str:
    return (f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {json.dumps(str(data))}\ntest_split: test\noutput_type: {kind}\n"
            f"doc_to_text: '{{{{context}}}}'\n{body}")


def write_tasks(folder: Path) -> Path:
    """The study's task folder (``--lm-eval-include-path``), written once."""
    folder = Path(folder)
    data = folder / "passages.jsonl"
    files = {
        data: "".join(json.dumps(p, sort_keys=True) + "\n" for p in passages()),
        folder / f"{NEXT_WORD}.yaml": _yaml(
            NEXT_WORD, data, "multiple_choice", "doc_to_choice: choices\n"
            "doc_to_target: label\nmetric_list:\n  - metric: acc\n"),
        folder / f"{CLOZE}.yaml": _yaml(
            CLOZE, data, "loglikelihood", "doc_to_target: \"{{' ' + choices[label]}}\"\n"
            "metric_list:\n  - metric: acc\n  - metric: perplexity\n"),
    }
    for path, text in files.items():
        if path.exists() and path.read_text(encoding="utf-8") != text:
            raise UsageError(f"{path} holds other tasks than this study writes: move it away "
                             "or choose another output folder")
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        if not path.exists():
            path.write_text(text, encoding="utf-8")
    return folder
