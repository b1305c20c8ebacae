from kvrig.cli import main

main()
