"""Pure single-device model code (installed as megazero.models)."""
from .config import GPTConfig, padded_vocab_size
from .gpt import GPT, initial_value

__all__ = ["GPT", "GPTConfig", "initial_value", "padded_vocab_size"]
