"""`python -m plait.run ...` is `plait run ...`."""

import os
import sys

from plait.run import main

if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Every worker is stopped and every file closed by now; skipping interpreter teardown saves
    # the ~0.7 s torch's modules take to unload when the launcher imported it for a store.
    os._exit(code)
