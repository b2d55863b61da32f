"""The report's last section: what reproduces the audit and how its cache was used
(the command, model, data, sites, seeds, settings, versions, host, replay schedule, cache
on disk, and the proof behind every reused batch and run)."""

from __future__ import annotations

from typing import Any

from fcaudit.engine.result import AuditResult
from fcaudit.report.markdown import md_code, md_fenced, md_kv_table, md_table, md_text


def _sites_table(r: AuditResult) -> str:
    rows = []
    for fam in r.families:
        sites = [s for s in r.sites if s.family == fam]
        shapes = list(dict.fromkeys(str(s.trailing_shape) for s in sites))
        shown = ", ".join(shapes) if len(shapes) <= 3 else \
            f"{shapes[0]} … {shapes[-1]} ({len(shapes)} distinct)"
        axes = sites[0].axes
        named = "" if axes is None else " (axes " + ", ".join(
            f"{a}*" if i in (sites[0].positions or []) else a for i, a in enumerate(axes)) + \
            "; * = positions)"
        found = next((s.layout for s in sites if s.layout), None)  # how, when undeclared
        named += f"; {found}" if found else ""
        rows.append((md_code(fam), str(len(sites)), md_code(sites[0].name),
                     md_code(sites[-1].name), shown + md_text(named)))
    return md_table(("family", "sites", "first", "last", "trailing shapes"), rows, "lrlll")


def reproducibility_section(r: AuditResult) -> list[str]:
    """What reproduces the audit: the command, model, data, sites, seeds, settings,
    versions, host, schedule, cache, and what this run took from the cache and how that
    was proven."""
    raw = r.to_json()
    blocks = ["## Reproducibility",
              md_fenced(r.command) if r.command else "Command not recorded.",
              f"Schema {md_code(r.schema)}, fcaudit {md_code(r.fcaudit_version)}.",
              "### Model", md_kv_table(raw["model"])]
    if r.data:
        blocks += ["### Data", md_kv_table(r.data)]
    if r.sites:
        blocks += ["### Sites", _sites_table(r)]
    for title, section in (("Seeds", raw["seeds"]), ("Settings", r.settings),
                           ("Versions", r.versions), ("Host", r.runtime.host),
                           ("Placement", r.runtime.placement or {}),
                           ("Replay schedule", r.runtime.schedule or {}),
                           ("Cache on disk", r.runtime.cache or {})):
        if section:
            blocks += [f"### {title}", md_kv_table(section)]
    return blocks + ([_reuse_sentence(r.runtime.reuse)] if r.runtime.reuse else [])


def _reuse_sentence(reuse: dict[str, Any]) -> str:
    total = reuse["batches_reused"] + reuse["batches_recomputed"]
    proven = sum(reuse.get(f"{stage}_batches_proven", 0)
                 for stage in ("evaluation", "calibration"))
    proofs = (f"Record results: {proven} cached batches used, each only after its original "
              "pass, recomputed in this audit (one forward pass each), equalled the cached "
              "record bit for bit. ") if proven else ""
    return (f"{proofs}Replay results: {reuse['batches_reused']} of {total} batches "
            f"({reuse['runs_reused']} runs) reused from the cache, each run's fed coefficients "
            f"checked bit for bit against this audit's{_replay_proof(reuse)}; "
            f"{reuse['batches_recomputed']} batches ({reuse['runs_recomputed']} runs) replayed.")


def _replay_proof(reuse: dict[str, Any]) -> str:
    """What proved the reused replay runs: a sample (its size, share and seed) or all."""
    verified = reuse.get("replay_runs_verified")
    if not reuse["batches_reused"] or verified is None:
        return ""
    if reuse["verify_reuse"] == "all":
        return (f", and every one of them ({verified} runs) replayed again and found equal to "
                "the cache bit for bit")
    share = reuse.get("replay_share_verified") or 0
    return (f", and a sample drawn afresh at this resume (seed {reuse['verify_seed']}), "
            f"{verified} runs ({100 * share:.1f}% of those reused: every run of the plan on "
            f"one of {reuse['replay_batches_verified']} cached batches), replayed again and "
            "found equal to the cache bit for bit (a sample proves every run somewhere, not "
            "every batch: see docs/method.md, Reuse)")
