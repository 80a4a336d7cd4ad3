"""Data pipeline: corpus -> tokenizer -> .bin/.idx -> GPT samples -> train/valid/test datasets.

Re-exports the public entry points; each module's docstring says what it owns.
"""

from megazero.data.blended_dataset import BlendedDataset
from megazero.data.builders import build_train_valid_test_datasets, parse_data_path
from megazero.data.default_data import DEFAULT_VOCAB_SIZE, prepare_default_data
from megazero.data.gpt_dataset import GPTDataset, parse_split, split_document_ranges
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype
from megazero.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer, load_tokenizer, train_tokenizer

__all__ = [
    "BlendedDataset",
    "build_train_valid_test_datasets",
    "parse_data_path",
    "DEFAULT_VOCAB_SIZE",
    "prepare_default_data",
    "GPTDataset",
    "parse_split",
    "split_document_ranges",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "best_dtype",
    "TOKENIZER_TYPES",
    "Tokenizer",
    "build_tokenizer",
    "load_tokenizer",
    "train_tokenizer",
]
