"""Every state-space and hybrid family of tests/ssm_families.py, random-initialised, checked
for its selection sites.

For each family, builds its tiny random config (``tests/ssm_families.py``; float32, eval,
seed 0, nothing downloaded), asks fcaudit for its sites without ``--sites``
(``fcaudit.core.discovery.declared_sites``) and, on a batch of 3 x 12 random tokens (a
multiple of the xLSTM config's chunk size), checks:

* sites: how many selection sites (``Site.selection`` set) and every family found (a
  hybrid's routers beside them);
* identity: the logits under ``fcaudit.replay(model, fcaudit.record(model, ids))`` equal the
  plain forward bit for bit;
* donor: feeding each sequence the next one's selection coefficients (the other sites
  recorded as they were) changes every sequence's logits;
* audit: the audit a user runs, ``fcaudit audit`` with every option at its default
  (execution included) on the model saved with ``save_pretrained``
  (``benchmarks/sweep_audit.py``): ``yes`` with how the prefix schedule went, or the
  one line it failed with;
* seconds: building, discovering, the three passes and the audit (after one untimed
  forward of the first family, so that one-time set-up lands in no row).

Prints a Markdown table and writes docs/results/hf_ssm_sweep.json, which
``python docs/make_docs.py`` renders into docs/ssm.md.

    python benchmarks/hf_ssm_sweep.py [family ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from resultfile import ResultFile, add_json_option  # noqa: E402
from ssm_families import SSM_FAMILIES, VOCAB, build  # noqa: E402
from sweep_audit import default_audit  # noqa: E402

import fcaudit  # noqa: E402
from fcaudit.core.discovery import declared_sites  # noqa: E402

BATCH, SEQ_LEN = 3, 12
DONOR = [1, 2, 0]  # each sequence gets the next one's selection coefficients


def one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".replace("|", "/").splitlines()
    line = text[0] if text else type(err).__name__
    return line if len(line) <= 140 else line[:137] + "..."


def yes(ok: bool) -> str:
    return "yes" if ok else "no"


def check(family: str) -> dict[str, Any]:
    """One family's row: sites, identity, donor, the default audit (yes / no / error: ...)
    and seconds."""
    start = time.perf_counter()
    row: dict[str, Any] = {"selection_sites": 0, "families": {}, "identity": "",
                           "donor": "", "audit": ""}
    try:
        model = build(family)
        sites = declared_sites(model) or []
        row["families"] = dict(Counter(s.family for s in sites))
        chosen = [s for s in sites if s.selection is not None]
        row["selection_sites"] = len(chosen)
        ids = torch.randint(3, VOCAB, (BATCH, SEQ_LEN),
                            generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            plain = model(ids).logits
            recorded = fcaudit.record(model, ids)
            with fcaudit.replay(model, recorded):
                row["identity"] = yes(torch.equal(model(ids).logits, plain))
            swapped = recorded.with_coefficients({s.name: recorded[s.name][DONOR]
                                                  for s in chosen})
            with fcaudit.replay(model, swapped):
                given = model(ids).logits
        row["donor"] = yes(bool(chosen) and all(not torch.equal(given[i], plain[i])
                                                for i in range(BATCH)))
        row.update(default_audit(model, VOCAB, SEQ_LEN))
    except Exception as err:  # noqa: BLE001 (reported, then the next family)
        for key in ("identity", "donor", "audit"):
            row[key] = row[key] or f"error: {one_line(err)}"
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row


def passes(row: dict[str, Any]) -> bool:
    return row["selection_sites"] > 0 and all(row[k] == "yes" for k in CHECKS)


CHECKS = ("identity", "donor", "audit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", metavar="family", help="default: every family")
    add_json_option(parser, "hf_ssm_sweep")
    args = parser.parse_args()
    record = ResultFile("hf_ssm_sweep.py")
    record.start()
    start = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    families = [f for f in SSM_FAMILIES if not args.only or f in args.only]
    with warnings.catch_warnings(), torch.no_grad():  # one-time set-up, outside every row
        warnings.simplefilter("ignore")
        build(families[0])(torch.ones(1, 2, dtype=torch.long))
    for family in families:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows[family] = check(family)
        print(f"  {family}: {rows[family]}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"batch {BATCH} x {SEQ_LEN} tokens, {wall:.0f} s\n")
    print("| family | selection sites | site families | identity | donor | default audit | "
          "seconds |")
    print("|---|---|---|---|---|---|---|")
    for family, r in rows.items():
        found = ", ".join(f"{k} {v}" for k, v in r["families"].items())
        print(f"| {family} | {r['selection_sites']} | {found} | {r['identity']} | "
              f"{r['donor']} | {r['audit']} | {r['seconds']:.2f} |")
    record.write(args.json, {"transformers": transformers.__version__, "batch": BATCH,
                             "seq_len": SEQ_LEN, "rows": rows,
                             "passed": [f for f, r in rows.items() if passes(r)],
                             "failed": [f for f, r in rows.items() if not passes(r)],
                             "wall_s": wall})


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(2)
    main()
