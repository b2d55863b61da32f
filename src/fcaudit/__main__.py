"""``python -m fcaudit`` (and ``torchrun ... -m fcaudit audit ...``)."""

import sys

from fcaudit.cli import main

sys.exit(main())
