"""Training a small demo target model and DFlash drafter on data found on this machine.

``tokenizer`` and ``data`` turn the Python sources installed here into a tokenized corpus and
serve it back as training batches and held-out prompts. Like the parent package, this package
imports nothing eagerly: import the submodule you need.
"""
