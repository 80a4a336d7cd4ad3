"""megazero/config/flags.py with megatron_flags.txt: every Megatron-LM flag megazero lacks gets the
"Megatron-LM flag megazero does not have" line, never a "did you mean"; a misspelling of megazero's own
flags still gets its nearest flag.

megatron_flags.txt is Megatron-LM's own parser read back (tools/megatron_flag_list.py); these checks
hold it to that: Megatron-LM's argument groups are all there, and a name from each group is recognised.
"""

import pytest

from megazero.config.flags import (
    _unknown_flag_error,
    build_parser,
    megatron_flag_groups,
    megatron_flags_megazero_lacks,
    parse_args,
)
from megazero.core.errors import UsageError

LACKS = "is a Megatron-LM flag megazero does not have"

# Argument groups of megatron/training/arguments.py (megatron-core 0.16's tree, then the newer one's),
# with a flag each declares: the file must keep them where Megatron-LM's parser puts them.
GROUP_SAMPLES = {
    "network size": "--num-layers",
    "regularization": "--attention-dropout",
    "training": "--micro-batch-size",
    "initialization": "--seed",
    "learning rate": "--lr-decay-style",
    "checkpointing": "--ckpt-fully-parallel-save",
    "mixed precision": "--fp16",
    "distributed": "--tensor-model-parallel-size",
    "validation": "--eval-iters",
    "data and dataloader": "--split",
    "tokenizer": "--tokenizer-type",
    "moe": "--num-experts",
    "logging": "--log-throughput",
    "Transformer-Engine": "--fp8-format",
    "inference": "--inference-max-seq-length",
    "transformer configuration": "--hybrid-context-parallel",
    "older Megatron-LM and Megatron-DeepSpeed": "--data-impl",
}


def _error(argv) -> str:
    with pytest.raises(UsageError) as raised:
        parse_args(argv)
    return str(raised.value)


def test_the_list_is_megatron_lms_parser_by_group():
    groups = megatron_flag_groups()
    flags = [flag for group in groups.values() for flag in group]
    assert len(groups) >= 40 and len(flags) > 900 and len(flags) == len(set(flags)), (len(groups), len(flags))
    assert all(flag.startswith("--") and " " not in flag for flag in flags)
    for group, flag in GROUP_SAMPLES.items():
        assert flag in groups[group], (group, flag)


def test_a_flag_megazero_lacks_from_every_group_gets_the_megatron_line():
    """Every group: its flags megazero takes parse, and each one it lacks is named as Megatron-LM's;
    every lacking flag of the whole list is checked on one parser (no "did you mean" anywhere)."""
    parser = build_parser()
    lacking = megatron_flags_megazero_lacks()
    assert {"--fp8-format", "--qk-layernorm", "--ckpt-fully-parallel-save"} <= lacking
    for group, flags in megatron_flag_groups().items():
        missing = [f for f in flags if f in lacking]
        taken = [f for f in flags if f not in lacking]
        assert all(f in parser._option_string_actions for f in taken), group
        if missing:  # end to end, with a value after it as a launch line writes it
            message = _error([missing[0], "1", "--num-layers", "2"])
            assert message.startswith(f"{missing[0]} {LACKS}") and "did you mean" not in message, message
    for flag in sorted(lacking):
        _, extras = parser.parse_known_args([flag])
        assert extras == [flag], flag
        assert LACKS in str(_unknown_flag_error(parser, [flag])), flag


@pytest.mark.parametrize(
    "argv", [["--fp8-format", "e4m3"], ["--qk-layernorm"], ["--ckpt-fully-parallel-save"], ["--fp8-format=hybrid"]]
)
def test_the_issues_examples(argv):
    message = _error(argv)
    assert LACKS in message and "did you mean" not in message, message


def test_a_misspelt_megazero_flag_still_gets_its_nearest():
    assert "did you mean --hidden-size?" in _error(["--hiden-size", "64"])
    assert "did you mean" not in _error(["--completely-unknown-thing"])
