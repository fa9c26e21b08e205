"""engine.pp: pipeline parallelism: which layers a stage holds, and the process group of a
PP x TP worker with its bounded point-to-point hand-offs."""
