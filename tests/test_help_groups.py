"""Every `--help` groups its options by what they are about: a walk over the parser of
every command checks each option's group against a table written here by hand (what a
user looks for under that heading), so a general option (`--debug`, `--quiet`, `-h`) is
never listed among the data options again."""

from __future__ import annotations

import argparse

import pytest

from fcaudit.cli.parser import build_parser

GENERAL = {"-h", "--debug"}
DATA = {"--data", "--calib-data", "--tokens", "--calib-tokens", "--inputs", "--targets",
        "--calib-inputs", "--calib-targets", "--seq-len", "--max-eval", "--max-calib"}
# for each command: the group title's first words -> the options it lists
EXPECTED = {
    "": {"general options": GENERAL},
    "train": {"training": {"--arch", "--preset", "--seed", "--out", "--steps", "--force",
                           "--device", "--data", "--task"},
              "general options": GENERAL | {"--quiet"}},
    "audit": {"model and output": {"--model", "--out", "--sites", "--site-axes", "--dense",
                                   "--blocks", "--dtype", "--device"},
              "data": DATA,
              "models bigger than memory": {"--device-map", "--max-memory", "--offload-folder"},
              "where the passes run": {"--engine", "--engine-memory-share",
                                       "--tensor-parallel-size", "--pipeline-parallel-size"},
              "audit settings": {"--repeats", "--seed", "--bootstrap", "--batch-size",
                                 "--no-per-layer", "--no-execution", "--timing-pairs",
                                 "--allow-nonexact-identity", "--schedule", "--verify-reuse",
                                 "--expert-ablation", "--frontier", "--frontier-points",
                                 "--target-ci", "--min-sequences", "--early-exit",
                                 "--exit-threshold", "--objective", "--condition"},
              "benchmark tasks": {"--lm-eval-tasks", "--lm-eval-include-path",
                                  "--lm-eval-limit"},
              "general options": GENERAL | {"--quiet"}},
    "compare": {"comparison": {"--out", "--label", "--allow-different-data"},
                "general options": GENERAL},
    "demo": {"demo": {"--out", "--train", "--seed"}, "general options": GENERAL | {"--quiet"}},
    "bench": {"benchmark": {"--model", "--dense", "--blocks", "--batch-size", "--seq-len",
                            "--pairs", "--seed", "--device", "--json"},
              "general options": GENERAL},
    "reproduce": {"study": {"--preset", "--seeds", "--out", "--mudd-checkpoint", "--repeats",
                            "--bootstrap", "--max-eval", "--max-calib", "--steps",
                            "--train-data"},
                  "general options": GENERAL | {"--quiet"}},
    "sites": {"listing": {"--model", "--all", "--inputs"}, "general options": GENERAL},
    "routes": {"comparison": {"--model", "--tokens", "--trace", "--prompt-start", "--engine",
                              "--batch-size", "--tensor-parallel-size", "--json"},
               "general options": GENERAL},
    "fold": {"fold": {"--audit", "--profile", "--out", "--force", "--model", "--timing-pairs",
                      "--json"},
             "data (the audit's: default the built-in plays, as fcaudit audit; checked by "
             "SHA-256)": {"--data", "--calib-data", "--tokens", "--calib-tokens", "--seq-len",
                          "--max-eval", "--max-calib"},
             "heal (fine-tune the folded model; the original alike as the control)": {
                 "--heal-steps", "--heal-data", "--heal-params", "--heal-out"},
             "general options": GENERAL | {"--quiet"}},
    "tasks": {"tasks": {"--audit", "--tasks", "--include-path", "--limit", "--model", "--json"},
              "data (the audit's: default the built-in plays, as fcaudit audit; checked by "
              "SHA-256)": {"--data", "--calib-data", "--tokens", "--calib-tokens", "--seq-len",
                           "--max-eval", "--max-calib"},
              "general options": GENERAL | {"--quiet"}},
}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    top = build_parser()
    commands = top._subparsers._group_actions[0].choices
    return {"": top, **commands}


def _groups(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Each listed group's options (first flag of each), as `--help` prints them."""
    return {group.title: {a.option_strings[0] for a in group._group_actions
                          if a.option_strings}
            for group in parser._action_groups
            if any(a.option_strings for a in group._group_actions)}


def test_every_command_is_in_the_table() -> None:
    assert set(_parsers()) == set(EXPECTED)


@pytest.mark.parametrize("command", list(EXPECTED))
def test_each_option_is_listed_in_the_group_it_belongs_to(command: str) -> None:
    groups = _groups(_parsers()[command])
    expected = EXPECTED[command]
    assert len(groups) == len(expected), groups
    for title, options in groups.items():
        [key] = [k for k in expected if title.startswith(k)]
        assert options == expected[key], (command, title)
    text = _parsers()[command].format_help()
    general = text.index("general options:")
    assert text.index("--debug", general) > general  # printed under its heading
    assert "show tracebacks on errors" in text[general:]


def test_debug_works_before_and_after_the_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["--debug", "sites", "--model", "m"]).debug is True
    assert parser.parse_args(["sites", "--model", "m", "--debug"]).debug is True
    assert parser.parse_args(["sites", "--model", "m"]).debug is False
    quiet = parser.parse_args(["audit", "--model", "m", "--out", "o", "--quiet"])
    assert quiet.progress is False
