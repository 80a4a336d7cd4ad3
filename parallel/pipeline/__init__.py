"""Pipeline parallelism: cutting the model into stages (split), moving activations and gradients
between neighbouring stages (p2p), and the schedules (GPipe, 1F1B, interleaved 1F1B, and the zero-bubble ones written as lists of
actions: actions.py, zero_bubble.py, run by action_runner.py)."""
