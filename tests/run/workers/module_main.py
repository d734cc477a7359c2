"""Run with `plait run -m tests.run.workers.module_main`: prints its rank and arguments."""

import os
import sys

print(f"module rank {os.environ['RANK']} argv {sys.argv[1:]}")
