"""Data in: text and parallel text, tokenized once into a cache, cut into training batches.

- ``corpus.py``: text sources (files, folders, globs, .gz, ``datasets``, the built-in corpus);
- ``token_cache.py``: a corpus tokenized into a memory-mapped file of ids, reused across runs;
- ``windows.py``: ``Batch``, the training windows of a token stream and the validation windows;
- ``pairs.py``: parallel text for translation: readers, the pair cache, length-bucketed batches;
- ``train_data.py``: ``load_train_data``: a TrainConfig's tokenizer, training and validation data.
"""
