"""deploy: what operators run: the `pdserve` CLI (deploy.cli), the control plane
(deploy.control), the checkpoint writers (deploy.checkpoints), and the cluster configs and
observability assets beside them."""
