"""fcaudit: the Frozen Controller Audit.

Three separate questions about a model with controllers (gates, mixing-weight
generators, routers): do the coefficients *vary*; does the *frozen* model
*depend* on each coefficient tensor staying matched to its input and token; and
does the mechanism change *execution*?
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import FcauditError  # noqa: E402
from .loading import load_model  # noqa: E402
from .record import record  # noqa: E402

__all__ = ["FcauditError", "__version__", "load_model", "record", "audit"]


def audit(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - thin lazy wrapper
    """Run the full audit (see :func:`fcaudit.audit_run.run_audit`); returns audit.json content."""
    from .audit_run import run_audit
    return run_audit(*args, **kwargs)
