"""``python -m shardkit.cluster.engines.torchrun``: what a torchrun node's agent starts for each worker
(`shardkit.cluster.engines.torchrun.main`)."""

import sys

from shardkit.cluster.engines.torchrun import main

sys.exit(main())
