import sys

from mpgraph.cli import main

sys.exit(main())
