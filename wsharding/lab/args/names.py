"""The names the command offers as choices, written here because the modules that define them import torch.

Each tuple equals the sorted keys of its table (``tests/lab/test_cli_fast.py`` checks it): a preset added
there and not here is refused by the command with the list of those it knows.
"""

#: ``sorted(wsharding.models.PRESETS)``: the decoder presets.
DECODER_PRESETS = ("k3-like", "small", "tiny", "tiny-deep")
#: ``sorted(wsharding.models.blocks.BLOCK_PRESETS)``: the stacks of Llama-like blocks.
BLOCK_PRESETS = ("cpu-blocks", "llama8b-blocks", "tiny-blocks")
#: ``wsharding.comm_by_name.COMM_CHOICES``: "auto" and the registry's communicators, in its order.
COMM_CHOICES = ("auto", "nccl", "torch")
