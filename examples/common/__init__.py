"""What the example scripts share, one concern per module (the scripts import them as ``from common import ...``,
with ``examples/`` on ``sys.path``):

- ``arguments``: the shared command-line flags, the help formatter, checks of flag values.
- ``data``: the offline tokenizer and book, datasets, batching modes, token files, collators, data loaders.
- ``models``: size presets, loading a base model, the demo base model, LoRA, activation checkpointing.
- ``training``: the Accelerator, AdamW, evaluation and the Accelerate training loop.
- ``checkpoints``: saving, finding and resuming from checkpoint-N folders.
- ``metrics``: metrics.csv, written and read.
- ``files``: the examples' cache folder and atomic writes.
"""
