"""megazero: GPT training with tensor x pipeline x ZeRO data parallelism.

The rooms and the way their imports run are drawn in docs/design.md: launch.py (the driver) and
training.py at this level; core/ (comm, streams, errors) at the bottom; config/ (the command-line
edge), zero/, ops/, data/, checkpoint/ between; megazero.models and megazero.parallel installed
from the repository's models/ and parallel/.
"""
