"""Constrained decoding: the tokens a turn may take next, so its reply is JSON that validates against a schema.

Built on llguidance (chosen by measurement against outlines-core: see
``bench/bench_grammar_libraries.py`` and docs/structured-outputs.md): a JSON
schema compiles to a grammar, the grammar and the model's tokenizer to a
matcher, and the matcher says after each token which tokens may follow, as a
bitmask over the vocabulary, in tens of microseconds. A reply that loops inside
its JSON is steered to the shortest end the grammar allows (json_shape.py
notices the loop, loop_closing.py ranks the tokens that close it).
"""
