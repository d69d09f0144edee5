"""The planner: TPU slices, model sizes, and the TPU and CPU-host plans built from compiled steps."""
