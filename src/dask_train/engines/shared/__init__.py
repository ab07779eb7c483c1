"""What the engines share: the role-engine base and its feeding, the worker-side role harness,
the scorer, parameter holders and how roles reach them, the flat optimizer, control signals."""
