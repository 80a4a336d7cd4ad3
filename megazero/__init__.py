"""megazero: GPT training with tensor x pipeline x ZeRO data parallelism.

The rooms and the way their imports run are drawn in docs/design.md: run/ (the driver and the
recipe), dry_run/ and training/ at the top; core/ (comm, streams, errors) at the bottom; config/
(the command-line edge), api/ (DeepSpeed's API for any nn.Module), zero/, ops/, data/, checkpoint/ between;
megazero.models and megazero.parallel installed from the repository's models/ and parallel/.

DeepSpeed's top-level names are answered here, imported on first use (flags are checked before
torch loads, so importing megazero loads nothing): `megazero.initialize`, `megazero.init_distributed`,
`megazero.add_config_arguments`; `megazero.zero.Init` & co. and `megazero.utils.safe_get_*` are in
megazero/zero/__init__.py and megazero/utils.py (docs/own_model.md).
"""


def __getattr__(name):
    if name == "initialize":
        from megazero.api.initialize import initialize

        return initialize
    if name == "init_distributed":
        from megazero.api.groups import init_distributed

        return init_distributed
    if name == "add_config_arguments":
        from megazero.api.arguments import add_config_arguments

        return add_config_arguments
    if name == "utils":
        import megazero.utils as utils

        return utils
    raise AttributeError(f"module 'megazero' has no attribute {name!r}")
