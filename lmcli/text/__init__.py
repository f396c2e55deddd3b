"""Text in and out of a model: tokenizers and chat templates.

- ``tokenizer.py``: char, byte and BPE tokenizers and Hugging Face's, behind one ``Tokenizer``;
- ``chat_template.py``: conversations as prompts (lmcli's template, or a model's own Jinja
  template), the roles' rule;
- ``template_render.py``, ``template_worker.py``: a model's Jinja template rendered in a bounded,
  sandboxed worker process.
"""
