"""The report's ``--target-ci`` section: the stopping rule, each round, why it stopped,
what it cost, and the optional-stopping caveat (from audit.json's ``stopping``)."""

from __future__ import annotations

from fcaudit.engine.result import AuditResult, Stopping
from fcaudit.report.markdown import md_code, md_table, md_text


def _rounds_table(s: Stopping) -> str:
    rows = [(str(i), str(r.sequences), str(r.batches), str(r.record_batches_new),
             str(r.replay_passes), md_text(r.widest), f"{r.half_widths[r.widest]:.4g}",
             "yes" if r.met else "no")
            for i, r in enumerate(s.rounds, start=1)]
    return md_table(("round", "sequences", "batches", "new record batches", "replay passes",
                     "widest interval", "half-width (nats)", "target met"), rows, "rrrrrlrl")


def _reuse_line(r: AuditResult) -> str:
    """What this run took from the cache, per round (runtime facts: a rerun differs)."""
    parts = [f"round {i}: {c['record_batches_reused']} record batches reused, "
             f"{c['record_batches_recorded']} recorded, {c['runs_reused']} replay passes "
             f"reused ({c.get('replay_runs_verified', 0)} of them replayed again as their "
             f"proof), {c['runs_recomputed']} recomputed, {c['wall_s']:.1f} s"
             for i, c in enumerate(r.runtime.rounds or [], start=1)]
    return ("This run: " + "; ".join(parts) + ". A replay run is reused only when its token "
            "ids and every tensor it is fed match bit for bit and a fresh sample of the reused "
            "runs, replayed again, equals the cache bit for bit; the random conditions' feeds "
            "depend on the number of sequences (the derangement), so they are replayed again "
            "in each new round.") if parts else ""


def stopping_section(r: AuditResult) -> list[str]:
    """The section, or nothing for a fixed audit."""
    s = r.stopping
    if s is None:
        return []
    counted = ", ".join(md_code(c) for c in s.conditions)
    overhead = s.replay_passes_total / s.replay_passes_fixed if s.replay_passes_fixed else 0.0
    blocks = ["## Stopping rule (--target-ci)",
              f"**{md_text(s.reason[0].upper() + s.reason[1:])}.** Target: every counted "
              f"penalty's 95% interval within {s.target_ci:g} nats of its estimate on each "
              f"side; counted: {counted}. Floor: {s.min_sequences} sequences; pool: "
              f"{s.pool_sequences} sequences in a seeded order (seed {s.order_seed}), each "
              "round auditing its first sequences exactly as a fixed audit of them would.",
              _rounds_table(s),
              f"Cost: {len(s.rounds)} round(s), {s.replay_passes_total} replay passes in all "
              f"against {s.replay_passes_fixed} for a fixed audit of the "
              f"{s.sequences_used} sequences used ({overhead:.2f}x). Growth: "
              f"{md_text(s.growth)}.",
              f"**Caveat:** {md_text(s.caveat)}."]
    reuse = _reuse_line(r)
    return blocks + ([reuse] if reuse else [])
