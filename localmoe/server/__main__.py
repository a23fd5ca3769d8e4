"""`python -m localmoe.server` = `localmoe serve`."""

from localmoe.commands.serve import main

main()
