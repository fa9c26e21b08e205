"""deploy.cli: the `pdserve` command line and the clients it talks to a cluster with."""
