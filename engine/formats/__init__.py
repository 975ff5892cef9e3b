"""What a model's text looks like: prompts rendered from conversations, tool calls and reasoning read back.

Beneath the HTTP protocols and above the models and grammars, so that adding
a model's format never touches a protocol: ``rendering.py`` turns a neutral
conversation into the prompt (the model's chat template, or the fallback
for a tokenizer without one), ``vision_rendering.py`` places the images'
tokens, ``rendered_heads.py`` remembers rendered prompts' heads per agent,
``reasoning_recall.py`` gives a reply's reasoning back to the template when a
client sent the reply without it, and ``tools/`` finds the tool calls in
generated text (one file a format) and constrains them to a grammar.
How a loaded tokenizer marks its reasoning is read when the model loads
(``engine/models/reasoning_format.py``), below this layer.
"""
