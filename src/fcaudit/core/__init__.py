"""fcaudit.core: recording, replaying and intervening on controller sites of any model.

The mechanism, knowing no model family: the model contract, adapters, site discovery,
record / replay, interventions and the per-token NLL (docs/architecture.md)."""
