"""``python -m fcaudit`` (and ``torchrun ... -m fcaudit audit ...``)."""

import sys

from .cli import main

sys.exit(main())
