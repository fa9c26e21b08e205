"""planner: the scaling planner (a pure decision core, the loop that feeds and actuates it,
trace replay)."""
