"""The per-block MILP planner (filled by the planner issue)."""
