from localmoe.cli import main

main()
