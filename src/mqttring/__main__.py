"""``python -m mqttring ...``: the ``mqttring`` command without the console script on PATH."""

import sys

from mqttring.cli import main

sys.exit(main())
