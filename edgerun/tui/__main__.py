"""`python -m edgerun.tui`: the same as `edgerun chat`."""

from edgerun.tui.app import main

main()
