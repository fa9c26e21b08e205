"""`python -m deploy.cli ...`: the `pdserve` command."""

from deploy.cli.app import main

main()
