"""``python -m shardkit.cli``: the ``shardkit`` command."""

import sys

from shardkit.cli import main

sys.exit(main())
