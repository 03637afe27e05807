"""`python -m moe_launcher.prepare_data`: JSON lines / Parquet text -> megatron indexed datasets.

The output is what megatron's own preprocessing writes for the same tokenizer: one
PREFIX_<key>_document.bin/.idx pair per JSON key, tokenized exactly as a training run with
`--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR` tokenizes.

  inputs.py      which files, and reading them in chunks (JSON lines, gzip, Parquet)
  tokenizer.py   loading the tokenizer as a training run does
  tokenize_chunks.py  what a worker does to one chunk
  pipeline.py    the worker pool, in order and with bounded memory
  output.py      writing under temporary names, committing by rename
  progress.py    the progress bar or log lines, and the summary
  cli.py         flags, refusals and exit codes
"""
