from dsv4serve.cli import main

main()
