"""Every supported Hugging Face MoE family, random-initialised, audited end to end.

Builds the tiny random config of each family that ``tests/test_model_hf.py`` tests (nothing
is downloaded), saves it as a local folder, and runs ``fcaudit.audit`` on it: the sites
found, the identity replay's max difference, the reassign and shuffle penalties with
their intervals, the share of top-k expert sets reassign changes, and the experts that
ran per token and layer. Random weights: the penalties say the audit reaches each
family's routing, not what a trained model does.

    python benchmarks/moe_families.py [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import FAMILIES, save, token_batches  # noqa: E402
from resultfile import ResultFile, add_json_option  # noqa: E402

from fcaudit.api import audit  # noqa: E402
from fcaudit.engine.run import AuditOptions
from fcaudit.io.data import AuditData, folder_tokenizer  # noqa: E402
from fcaudit.io.loading import load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_option(parser, "moe_families")
    args = parser.parse_args()
    record = ResultFile("moe_families.py")
    record.start()
    rows = []
    options = AuditOptions(repeats=2, bootstrap=500, batch_size=2, timing_pairs=0,
                           per_layer=False, progress=False)
    print("| family | sites (routers + shared gates) | identity max diff | reassign Δ [95% CI] "
          "| shuffle Δ [95% CI] | top-k sets re-routed (reassign) | experts run / token / "
          "layer |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family, (config, _, _) in FAMILIES.items():
            folder = save(config(), Path(tmp) / family)
            x, calib = token_batches(folder_tokenizer(folder))
            result = audit(load(str(folder)), data=AuditData(x.numpy(), calib.numpy()),
                           options=options)
            families = {}
            for s in result.sites:
                families[s.family] = families.get(s.family, 0) + 1
            cell = {k: f"{c.delta:+.3f} [{c.ci95[0]:+.3f}, {c.ci95[1]:+.3f}]"
                    for k, c in result.conditions.items()}
            moved = result.routing["router"].changed["reassign"] if result.routing else None
            ex = result.execution.experts
            per_layer = ", ".join(f"{v:.2f}" for v in ex.experts_per_token_per_layer) \
                if ex else "n/a"
            print(f"| {family} | {' + '.join(f'{n} {f}' for f, n in families.items())} | "
                  f"{result.identity_replay_max_abs_diff:g} | {cell['reassign']} | "
                  f"{cell['shuffle']} | {100 * moved:.1f}% | {per_layer} |", flush=True)
            rows.append({"family": family, "sites": families,
                         "identity_max_abs_diff": result.identity_replay_max_abs_diff,
                         **{k: {"delta": result.conditions[k].delta,
                                "ci95": result.conditions[k].ci95}
                            for k in ("reassign", "shuffle")},
                         "rerouted_reassign": moved,
                         "experts_per_token_per_layer":
                             ex.experts_per_token_per_layer if ex else None})
    record.write(args.json, {"repeats": options.repeats, "bootstrap": options.bootstrap,
                             "families": rows})


if __name__ == "__main__":
    main()
