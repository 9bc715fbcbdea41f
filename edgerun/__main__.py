import sys

from edgerun.cli import main

sys.exit(main())
