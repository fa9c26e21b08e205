"""engine.tp: tensor parallelism: the process group and how a model is sharded over it."""
