"""Offline data preparation: corpora -> sentences -> WordPiece -> NSP/MLM instances -> Arrow shards.

`python -m data.prepare data=sample` (or `make prepare DATA=sample`) writes
`data/prepared/<name>/seq<L>/` with shards, `tokenizer.json` and `manifest.json`; training reads them
through `data.dataset.PretrainingDataset` and never tokenizes raw text.
"""
