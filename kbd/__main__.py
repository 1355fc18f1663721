from kbd.cli.entry import main

main()
