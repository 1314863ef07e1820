from detaudit.cli import main

main()
