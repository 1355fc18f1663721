from kbd.entry import main

main()
