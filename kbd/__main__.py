from kbd.cli import main

main(prog_name="kbd")
