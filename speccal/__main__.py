from speccal.cli import main

main()
