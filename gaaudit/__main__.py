from gaaudit.cli import main

main()
