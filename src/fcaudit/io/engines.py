"""The engines an audit's passes can run in (``AuditOptions.engine``): PyTorch in this
process, or vLLM serving the model in this process (:mod:`fcaudit.io.vllm`). No torch
here: ``--help`` reads the choices."""

EAGER, VLLM = "eager", "vllm"
ENGINES = (EAGER, VLLM)
