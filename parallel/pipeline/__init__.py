"""Pipeline parallelism: cutting the model into stages (split), moving activations and gradients
between neighbouring stages (p2p), and the schedules (GPipe, 1F1B, interleaved 1F1B)."""
