"""`python -m tui`: the same as `edgerun chat`."""

from tui.app import main

main()
