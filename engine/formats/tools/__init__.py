"""Tool calls in generated text: one file a model's format, the stream that finds them, their grammar.

``calls.py`` picks a model's format (mlx-lm's parser for templates it
recognises, else the JSON fallback) and splits streamed text into text,
reasoning and tool-call pieces; ``scanning.py`` streams a call's arguments as
they are written, and each other file scans one family's format;
``grammar.py`` and ``constraints.py`` constrain a reply offered strict tools
or a forced tool_choice.
"""
