"""Measurements of the engine: synthetic workloads (workloads), real model shapes with peers
(shapes), and the microbenchmarks and engine runs the simulator is calibrated against
(measure)."""
