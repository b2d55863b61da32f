"""Model families: FeatureGate/Dense, SkipGate, MUDD, MoE, Mamba/S4D (and loaders for
checkpoints).

Each family implements :class:`fcaudit.core.contract.AuditableModel`: it declares its
controller sites, its execution blocks and its dense counterpart.
"""
