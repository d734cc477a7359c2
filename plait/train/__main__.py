import sys

from plait.train.cli import main

sys.exit(main())
