from ckptfmt.cli import main

main()
