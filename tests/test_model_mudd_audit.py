"""`fcaudit audit` on a MUDDPythia checkpoint folder, with the folder's own tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

from conftest import make_mudd_folder

from fcaudit.cli import main


def test_audit_a_mudd_folder_end_to_end(tmp_path: Path) -> None:
    folder = make_mudd_folder(tmp_path)
    words = ["now", "is", "the", "winter", "of", "our", "discontent", "made", "glorious",
             "summer", "by", "this", "sun"]
    rng = random.Random(0)  # varied text: no two windows alike
    (tmp_path / "essay.txt").write_text(" ".join(rng.choice(words) for _ in range(600)))

    out = tmp_path / "audit"
    code = main(["audit", "--model", str(folder), "--data", str(tmp_path / "essay.txt"),
                 "--seq-len", "32", "--max-eval", "6", "--max-calib", "6", "--repeats", "1",
                 "--bootstrap", "50", "--timing-pairs", "0", "--dtype", "float32", "--quiet",
                 "--out", str(out)])
    assert code == 0
    audit = json.loads((out / "audit.json").read_text())
    assert audit["model"]["kind"] == "hf-mudd"
    assert audit["identity_replay_max_abs_diff"] == 0.0
    assert [s["trailing_shape"] for s in audit["sites"]] == [[4, 2], [4, 3], [4, 4], [1, 5]]
    assert set(audit["variance"]) == {"mudd", "mudd.final"}
    assert audit["data"]["source"] == "text" and audit["data"]["seq_len"] == 32
    ex = audit["execution"]
    assert ex["measured"] and ex["blocks_executed"] == ex["blocks_present"] == 4
    assert (out / "report.html").is_file()
