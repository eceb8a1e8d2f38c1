from starqa.cli import main

main()
