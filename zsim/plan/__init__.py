"""The planner: which layout to run, ranked by the simulator."""
