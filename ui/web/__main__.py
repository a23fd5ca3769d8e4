"""`python -m localmoe.ui.web` = `localmoe web`."""

from localmoe.commands.web import main

if __name__ == "__main__":
    main()
