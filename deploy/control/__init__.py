"""deploy.control: the control plane: the config tree, cluster launch, the controller actor
with its worker registry, drain and rebalance, worker actors, LoRA admin and metrics."""
