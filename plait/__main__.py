import sys

from plait.cli import main

sys.exit(main())
